"""The MXFP4 pair (MXFP4 weights, MXFP8 tokens) on the SM90 decode chain, on the CPU: the MXFP8 values its sort +
permute and its activation write as BF16 (kernels_cuda/mxfp8.cuh, built for the host) against the project's
quantizer and torch's conversions; the weights on the engine (their own row-major tensors read in place, with the
globals of their exact shifted form); what the engine declares; the kernel wrappers and the decode forms the chain
compiles; and a dry run of the call through the executor. What the kernels compute on the GPU:
tests/engines/sm90/test_mx_pair_sm90_gpu.py."""

from __future__ import annotations

import contextlib
import importlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cudnn_moe import Routing
from cudnn_moe.activations import SwiGLU
from cudnn_moe.arch import SM90
from cudnn_moe.engines.base import OP_LOW_LATENCY, BlockCode, GemmShape, Request, WeightFormat
from cudnn_moe.engines.ll_mma.engine import LlMmaEngine
from cudnn_moe.engines.registry import supporting
from cudnn_moe.engines.sm90 import kernels as sm90_kernels
from cudnn_moe.engines.sm90.engine import Sm90GemmEngine
from cudnn_moe.engines.sm90.layout import to_token_fragments
from cudnn_moe.formats import quantize_mxfp8
from cudnn_moe import kernels
from cudnn_moe.kernels import IntermediateCode, SortBuffers, TokenLayout
from cudnn_moe.kernels import activate as kernel_activate
from cudnn_moe.kernels import permute as kernel_permute
from cudnn_moe.kernels import sort as kernel_sort
from cudnn_moe.kernels import stage as kernel_stage
from cudnn_moe.kernels.activate import check_activation_output
from cudnn_moe.low_latency import LowLatencyMoeConfig
from cudnn_moe.low_latency.fallback import grouped_view
from cudnn_moe.low_latency.tactics import layer_request
from cudnn_moe.pipeline import executor as executor_module
from cudnn_moe.pipeline.executor import MoeExecutor
from cudnn_moe.pipeline.tokens import TokenCode, token_code, token_operands
from cudnn_moe.weights.low_latency import Mxfp8Activations
from tests.engines.sm90.gpus import bare_engine
from tests.support.kernel_sources import HOST_PRELUDE, host_program
from tests.support.low_latency import mx_payloads

E8, F8 = torch.float8_e8m0fnu, torch.float8_e4m3fn
kernel_finalize = importlib.import_module("cudnn_moe.kernels.finalize")  # the package exports a function of that name
EXPERTS, HIDDEN, INTER = 4, 256, 128  # N1 = 2I a multiple of 128, as the SM90 kernels need

_VALUES_DRIVER = HOST_PRELUDE + r"""
#include "mxfp8.cuh"
using namespace moe;

// argv[1]: float32 blocks of 32 values -> argv[2]: per block the 32 BF16 values of its MXFP8 elements (what the
// activation's INTER_MXFP8 writes). Then every E4M3 byte c (NaN codes included) at every scale byte b: the BF16 of
// element c in a block of scale b (what the sort + permute writes for MXFP8 tokens), into argv[3].
int main(int argc, char** argv) {
  if (argc != 4) return 2;
  std::FILE* in = std::fopen(argv[1], "rb");
  std::FILE* out = std::fopen(argv[2], "wb");
  std::FILE* tokens = std::fopen(argv[3], "wb");
  if (!in || !out || !tokens) return 3;
  float v[32];
  while (std::fread(v, 4, 32, in) == 32) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(v[j]));
    const u32 b = mx_e4m3_scale_byte(amax);
    u16 bits[32];
    for (int j = 0; j < 32; ++j) bits[j] = mx_value_bf16(mx_e4m3_value(v[j], b), b);
    std::fwrite(bits, 2, 32, out);
  }
  for (u32 b = 0; b < 256; ++b)
    for (u32 c = 0; c < 256; ++c) {
      const u16 bits = mx_value_bf16(e4m3_to_float(static_cast<u8>(c)), b);
      std::fwrite(&bits, 2, 1, tokens);
    }
  return std::fclose(out) != 0 || std::fclose(in) != 0 || std::fclose(tokens) != 0;
}
"""


@pytest.fixture(scope="module")
def host_values(tmp_path_factory) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks float32 [N, 32], their values as the activation writes them, the token table [b, c]) from the host
    build."""
    folder = tmp_path_factory.mktemp("mxfp8")
    program = host_program(folder, "values", _VALUES_DRIVER)
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randn(2000, 32, generator=gen) * torch.pow(2.0, torch.randint(-125, 124, (2000, 1), generator=gen).float())]
    for k in range(-109, 119):  # amax at 448 * 2^k and just above, and 2^(k + 8): the edges of every scale byte
        for amax in (448 * 2.0**k, 448 * 2.0**k * (1 + 2.0**-23), 2.0 ** (k + 8)):
            block = torch.randn(32, generator=gen).clamp(-1, 1) * amax
            block[0] = amax
            blocks.append(block[None])
    blocks += [torch.zeros(1, 32), -torch.zeros(1, 32), torch.full((1, 32), 3.0e38)]
    x = torch.cat(blocks).float()
    x = torch.cat([x, -x])
    x.numpy().astype(np.float32).tofile(folder / "in.bin")
    subprocess.run([str(program), str(folder / "in.bin"), str(folder / "out.bin"), str(folder / "tokens.bin")],
                   check=True)
    written = torch.from_numpy(np.fromfile(folder / "out.bin", dtype=np.int16).copy()).view(torch.bfloat16)
    table = torch.from_numpy(np.fromfile(folder / "tokens.bin", dtype=np.int16).copy()).view(torch.bfloat16)
    return x, written.reshape(x.shape), table.reshape(256, 256)


def test_intermediate_values_are_the_mxfp8_elements(host_values) -> None:
    """INTER_MXFP8's BF16 values are quantize_mxfp8's elements times their block scales, bit for bit, for every block
    whose scale byte is at least 10 (amax at least 2^-109; the probes reach every byte 10 .. 246): exact. Below that
    (the random blocks reach amax 2^-125) each is the nearest-even BF16 of its element's value."""
    x, written, _ = host_values
    codes, scales = quantize_mxfp8(x)
    scale_bytes = scales.view(torch.uint8)
    exact = codes.double() * torch.pow(2.0, scale_bytes.double() - 127)
    in_range = (scale_bytes >= 10).expand_as(exact)
    assert set(scale_bytes.flatten().tolist()) >= set(range(10, 247)) and bool((~in_range).any())
    assert torch.equal(written.double()[in_range], exact[in_range]), "a value differs from its MXFP8 element"
    nearest = exact.float().bfloat16()  # the element's value is exact in FP32 (its lowest bit at least 2^-136)
    assert torch.equal(written[~in_range].view(torch.int16), nearest[~in_range].view(torch.int16))


def test_token_values_are_exact_within_the_stated_scales(host_values) -> None:
    """The sort + permute's BF16 of E4M3 code c in a block of scale byte b: for 10 <= b <= 246 exactly c x 2^(b - 127)
    (every code, both zeros); at every other byte the nearest-even BF16 of that value (or infinity past BF16's range,
    NaN for the scale byte 255); NaN codes stay NaN."""
    _, _, table = host_values
    codes = torch.arange(256, dtype=torch.uint8).view(F8).double()
    nan_code = torch.arange(256).bitwise_and(0x7F) == 0x7F
    for b in range(256):
        got = table[b]
        assert bool(got[nan_code].isnan().all()), f"scale byte {b}: a NaN code lost its NaN"
        if b == 255:
            assert bool(got.isnan().all()), "the NaN scale byte must give NaN"
            continue
        value = codes[~nan_code] * 2.0 ** (b - 127)
        want = value.float().bfloat16()  # exact in FP32 (|value| >= 2^-136), then nearest even
        assert torch.equal(got[~nan_code].view(torch.int16), want.view(torch.int16)), f"scale byte {b}"
        if 10 <= b <= 246:
            assert torch.equal(got[~nan_code].double(), value), f"scale byte {b}: a value is not exact"


_UNITS_DRIVER = HOST_PRELUDE + r"""
#include "mxfp8.cuh"
using namespace moe;

// argv[1]: rows of 64 E4M3 code bytes and then their 2 E8M0 scale bytes (two units) -> argv[2]: each row's 64 BF16
// values as the sort + permute stores them in the token-fragment order (piece q of unit u at columns 16q + 8u).
int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::FILE* in = std::fopen(argv[1], "rb");
  std::FILE* out = std::fopen(argv[2], "wb");
  if (!in || !out) return 3;
  unsigned char row[66];
  while (std::fread(row, 1, 66, in) == 66) {
    u16 frag[64];
    for (int u = 0; u < 2; ++u) {
      uint4 piece[4];
      expand_mxfp8_unit(fetch_mxfp8_unit(row, row + 64, 64, 0, u), piece);
      for (int q = 0; q < 4; ++q) std::memcpy(frag + 16 * q + 8 * u, &piece[q], 16);
    }
    std::fwrite(frag, 2, 64, out);
  }
  return std::fclose(out) != 0 || std::fclose(in) != 0;
}
"""


def test_token_units_land_in_the_fragment_order(tmp_path) -> None:
    """expand_mxfp8_unit (the sort + permute's and the routed GEMM1's MXFP8 token decode) puts each element's BF16
    value where to_token_fragments puts that column: random codes (NaN codes left out) at scale bytes 10 .. 246."""
    program = host_program(tmp_path, "units", _UNITS_DRIVER)
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (64, 64), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # 1.0
    scales = torch.randint(10, 247, (64, 2), generator=gen, dtype=torch.uint8)
    torch.cat([codes, scales], dim=1).numpy().tofile(tmp_path / "in.bin")
    subprocess.run([str(program), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    got = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype=np.int16).copy()).view(torch.bfloat16).reshape(64, 64)
    values = codes.view(F8).double() * torch.pow(2.0, scales.double() - 127).repeat_interleave(32, dim=1)
    want = to_token_fragments(values.bfloat16())
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def _pair(seed: int = 0, arch: str = "sm90"):
    w1, s1, w2, s2 = mx_payloads("mxfp4", True, EXPERTS, HIDDEN, INTER, seed)
    return LowLatencyMoeConfig(8, arch=arch).prepare_weights(w1, s1.view(E8), w2, s2)


def test_pair_view_reads_the_weights_in_place() -> None:
    """prepare_weights decides the MXFP4 pair's shifted form. Prepared for another arch the tensors stay row-major, as
    given, and the SM90 engine's view holds those very tensors (no copy: BlockCode.MXFP4_ROWS, the scales as their
    bytes) with the globals 2^a of the form as alphas."""
    w1, s1, w2, s2 = mx_payloads("mxfp4", True, EXPERTS, HIDDEN, INTER, 3)
    s1[0] -= 18  # expert 0's w1 scales 2^-27 .. 2^-22: its shifted form takes a = -18
    pair = LowLatencyMoeConfig(8, arch="sm100").prepare_weights(w1, s1.view(E8), w2, s2)
    assert not pair.tiled and pair.nvfp4_problem is None
    assert torch.equal(pair.w1_codes, w1) and torch.equal(pair.w2_codes, w2)  # row-major, as given (I = Ip)
    view = grouped_view(Sm90GemmEngine, SM90, pair)
    assert view.code is BlockCode.MXFP4_ROWS and view.spec == Sm90GemmEngine.spec(SM90)
    for got, own in ((view.w1, pair.w1_codes), (view.w1_scales, pair.w1_scales), (view.w2, pair.w2_codes),
                     (view.w2_scales, pair.w2_scales)):
        assert got.data_ptr() == own.data_ptr() and got.dtype == torch.uint8 and got.shape == (EXPERTS, own.numel() // EXPERTS)
    shifts1, shifts2 = pair.nvfp4_shifts
    assert int(shifts1[0]) == -18 and int(shifts1[1]) == 0
    assert torch.equal(view.w1_alpha, torch.pow(2.0, shifts1.float())) and torch.equal(view.w2_alpha, torch.pow(2.0, shifts2.float()))


def test_pair_prepared_for_sm90_is_stored_in_its_tiles() -> None:
    """Prepared for SM90, the pair with a shifted form is stored as the engine's MXFP4 tiles of that form, its only
    copy: canonical() gives the caller's tensors back bit for bit, the tiles are those of the weight-only MXFP4 layer
    of the same payloads, and the SM90 view holds the stored tensors themselves (BlockCode.MXFP4, no copy)."""
    w1, s1, w2, s2 = mx_payloads("mxfp4", True, EXPERTS, HIDDEN, INTER, 6)
    s1[1] -= 11
    config = LowLatencyMoeConfig(8, arch="sm90")
    pair = config.prepare_weights(w1, s1.view(E8), w2, s2)
    assert pair.tiled and pair.tile_form is not None
    for got, want in zip(pair.canonical(), (w1, s1.view(E8), w2, s2.view(E8))):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    weight_only = config.prepare_mxfp4_weight_only_weights(w1, s1.view(E8), w2, s2.view(E8))
    assert torch.equal(pair.w1_codes, weight_only.w1_codes) and torch.equal(pair.w2_codes, weight_only.w2_codes)
    for got, want in zip(pair.tile_form, weight_only.tile_form):
        assert torch.equal(got, want)
    view = grouped_view(Sm90GemmEngine, SM90, pair)
    assert view.code is BlockCode.MXFP4
    for got, own in ((view.w1, pair.w1_codes), (view.w1_scales, pair.tile_form[0]), (view.w2, pair.w2_codes),
                     (view.w2_scales, pair.tile_form[2])):
        assert got.data_ptr() == own.data_ptr()
    assert view.w1_alpha is pair.tile_form[1] and view.w2_alpha is pair.tile_form[3]


@pytest.mark.parametrize("engine", ["auto", "sm90", "cuda_cores", "ll_mma"])
def test_pair_is_tiled_for_every_engine_that_reads_tiles(engine: str) -> None:
    """A config for SM90 stores the pair as tiles unless it names ll_mma, whose kernels read row-major weights; a
    format ll_mma does not run (weight-only MXFP4) is tiled whatever engine the config names."""
    w1, s1, w2, s2 = mx_payloads("mxfp4", True, EXPERTS, HIDDEN, INTER, 7)
    config = LowLatencyMoeConfig(8, arch="sm90", engine=engine)
    assert config.prepare_weights(w1, s1.view(E8), w2, s2).tiled == (engine != "ll_mma")
    assert config.prepare_mxfp4_weight_only_weights(w1, s1.view(E8), w2, s2.view(E8)).tiled


def test_pair_without_a_shifted_form_has_no_view() -> None:
    """Scales spanning more binades than the form holds: the pair says why, has no SM90 view, and the SM90 engine
    does not take it (the CUDA-core engines do)."""
    w1, s1, w2, s2 = mx_payloads("mxfp4", True, EXPERTS, HIDDEN, INTER, 4)
    s1[0, 0, 0], s1[0, 1, 0] = 100, 140  # 40 binades apart in one expert
    pair = LowLatencyMoeConfig(8, arch="sm90").prepare_weights(w1, s1.view(E8), w2, s2)
    assert isinstance(pair.nvfp4_problem, str)
    with pytest.raises(ValueError, match="no exact shifted form"):
        grouped_view(Sm90GemmEngine, SM90, pair)
    request = layer_request(pair, SM90, 8, None, torch.bfloat16, True)
    assert Sm90GemmEngine not in supporting(request)
    assert "shifted form" in Sm90GemmEngine.check(request).reason


def test_sm90_engine_runs_the_mxfp4_pair_finalized_in_bf16() -> None:
    """The SM90 engine takes the MXFP4 pair (first in the registry: "auto" picks it untuned), finalized into BF16
    only; the MXFP8 pair (E4M3 weights) stays on the CUDA-core engines."""
    pair = _pair()
    request = layer_request(pair, SM90, 8, None, torch.bfloat16, True)
    assert [e.name for e in supporting(request)] == ["sm90", "cuda_cores"]  # tiles: ll_mma reads row-major only
    assert "row-major" in LlMmaEngine.check(request).reason
    row_major = layer_request(_pair(arch="sm100"), SM90, 8, None, torch.bfloat16, True)
    assert [e.name for e in supporting(row_major)] == ["sm90", "cuda_cores", "ll_mma"]
    for out_dtype, finalize in ((torch.float16, True), (torch.bfloat16, False)):
        assert Sm90GemmEngine not in supporting(layer_request(pair, SM90, 8, None, out_dtype, finalize))
    w1, s1, w2, s2 = mx_payloads("mxfp8", True, EXPERTS, HIDDEN, INTER, 0)
    mxfp8 = LowLatencyMoeConfig(8, arch="sm90").prepare_weights(w1, s1.view(E8), w2, s2)
    assert Sm90GemmEngine not in supporting(layer_request(mxfp8, SM90, 8, None, torch.bfloat16, True))


def test_mxfp8_tokens_are_their_own_kind() -> None:
    acts = Mxfp8Activations(torch.zeros(2, HIDDEN, dtype=torch.uint8).view(F8),
                            torch.zeros(2, HIDDEN // 32, dtype=torch.uint8).view(E8))
    assert token_code(acts) is TokenCode.MXFP8
    codes, scales = token_operands(acts)
    assert codes is acts.codes and scales is acts.scales


def test_the_mxfp8_intermediate_writes_bf16_layouts_only() -> None:
    rows, inter = 16, 128
    for layout in (TokenLayout.BF16_FRAGMENTS, TokenLayout.BF16_ROWS, TokenLayout.BF16_TILED):
        check_activation_output(torch.zeros(rows, inter, dtype=torch.bfloat16), None, layout, rows, inter,
                                IntermediateCode.MXFP8)
    with pytest.raises(ValueError, match="MXFP8 intermediate writes a BF16 layout only"):
        check_activation_output(torch.zeros(rows, inter // 2, dtype=torch.uint8), torch.zeros(rows * inter // 16),
                                TokenLayout.NVFP4_LINEAR, rows, inter, IntermediateCode.MXFP8)
    with pytest.raises(ValueError, match="must be an IntermediateCode"):
        check_activation_output(torch.zeros(rows, inter, dtype=torch.bfloat16), None, TokenLayout.BF16_ROWS, rows,
                                inter, True)


def _sorted(slots: int, rows: int) -> SortBuffers:
    i32 = torch.int32
    return SortBuffers(torch.zeros(EXPERTS + 1, dtype=i32), torch.zeros(slots, dtype=i32), torch.zeros(rows, dtype=i32),
                       torch.zeros(rows, dtype=i32), torch.zeros(EXPERTS, dtype=i32))


@pytest.mark.parametrize("staged", [False, True], ids=["bucket", "caller"])
def test_sort_permute_launches_the_mxfp8_kernel(monkeypatch: pytest.MonkeyPatch, staged: bool) -> None:
    """MXFP8 codes float8_e4m3fn [T, H] with 1-byte scales [T, H/32] select the _mxfp8 kernels, passing codes then
    scales; other shapes name what the launch takes."""
    launches: list[tuple[str, tuple]] = []
    monkeypatch.setattr(kernel_sort, "launch", lambda file, name, device, grid, block, args, **_: launches.append(
        (name, args)))
    for module in (kernel_sort, kernel_stage):
        monkeypatch.setattr(module, "ptr", lambda tensor, align=1, row_strided=False: tensor)
    tokens, top_k, rows = 2, 4, 64
    codes = torch.zeros(tokens, HIDDEN, dtype=torch.uint8).view(F8)
    scales = torch.zeros(tokens, HIDDEN // 32, dtype=torch.uint8).view(E8)
    xp = torch.zeros(rows, HIDDEN, dtype=torch.bfloat16)
    sorted_ = _sorted(tokens * top_k, rows)
    ids_out, w_out = torch.zeros(tokens, top_k, dtype=torch.int32), torch.zeros(tokens, top_k)

    def call(c: torch.Tensor, s: torch.Tensor) -> None:
        if staged:
            kernel_sort.stage_sort_permute_bf16(c, s, torch.zeros(tokens, top_k, dtype=torch.int32),
                                                torch.zeros(tokens, top_k), kernels.RoutingFormat.FP32, ids_out,
                                                w_out, 0, EXPERTS, 8, sorted_, xp)
        else:
            kernel_sort.sort_permute_bf16(ids_out.view(-1), top_k, 0, EXPERTS, 8, sorted_, c, s, xp)

    call(codes, scales)
    name, args = launches[-1]
    assert name == ("moe_stage_sort_permute_bf16_mxfp8_warp" if staged else "moe_sort_permute_bf16_mxfp8")
    assert any(a is codes for a in args) and any(a is scales for a in args)
    with pytest.raises(ValueError, match="MXFP8 codes"):
        call(codes, scales[:, :-1])
    with pytest.raises(ValueError, match="MXFP8 codes"):
        call(codes, torch.zeros(tokens, HIDDEN // 32, dtype=torch.float32))


@dataclass
class _View:
    """What MoeExecutor.__init__ reads of a weight view."""

    spec: object
    device: torch.device = torch.device("cuda", 0)  # an index: the stream order asks CUDA for none
    code: object = None


def _executor(engine_name: str = "sm90", bf16_rows: bool = True, **kwargs) -> MoeExecutor:
    spec = SimpleNamespace(describe=lambda: "spec")
    weights = _View(spec)
    engine = SimpleNamespace(layout=spec, name=engine_name, token_layout=SimpleNamespace(is_bf16=bf16_rows))
    args = dict(top_k=8, activation=None, local_expert_start=0, max_num_tokens=8, tokens=TokenCode.MXFP8,
                intermediate=IntermediateCode.MXFP8)
    return MoeExecutor(weights, engine, **{**args, **kwargs})


def test_executor_takes_mxfp8_tokens_within_the_sort_permute_launch() -> None:
    """An executor of MXFP8 tokens needs an engine reading BF16 rows and buckets that the sort + permute launch holds
    (max_num_tokens x top_k slots); its kinds must be the codes' own types."""
    executor = _executor()
    assert executor.tokens is TokenCode.MXFP8 and executor.intermediate is IntermediateCode.MXFP8
    with pytest.raises(ValueError, match="need an engine reading BF16 token rows"):
        _executor(engine_name="cudnn", bf16_rows=False)
    with pytest.raises(ValueError, match="of at most 1024 slots"):
        _executor(max_num_tokens=129)
    with pytest.raises(ValueError, match="must be a TokenCode"):
        _executor(tokens="mxfp8")
    with pytest.raises(ValueError, match="an IntermediateCode"):
        _executor(intermediate=2)


def test_request_of_the_pair_carries_its_form() -> None:
    """The pair's request says why its weights have no shifted form (None when they have one), as weight-only
    MXFP4's does; the shapes are its GEMMs'."""
    pair = _pair()
    request = layer_request(pair, SM90, 3, None, torch.bfloat16, True)
    assert request == Request(OP_LOW_LATENCY, SM90, "mxfp4_w_mxfp8_a", (
        GemmShape(HIDDEN, 2 * INTER, EXPERTS), GemmShape(pair.padded_intermediate, HIDDEN, EXPERTS)), EXPERTS, None,
        torch.bfloat16, True, 3, None, tiled=True)
    no_form = replace(pair, nvfp4_shifts="why")
    assert layer_request(no_form, SM90, 3, None, torch.bfloat16, True).nvfp4_problem == "why"


class _NoOrder:
    """Stands in for the executor's stream order on the CPU."""

    def __init__(self, device: torch.device) -> None:
        pass

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        yield


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[str, ...]]]:
    """(kernel, its extra compile options) of every launch, which is recorded instead of run; the CUDA-only
    checks and the stream order are stubbed out, so the executor runs on CPU tensors."""
    calls: list[tuple[str, tuple[str, ...]]] = []

    def record(source, name, device, grid, block, args, **kwargs) -> None:
        calls.append((name, tuple(kwargs.get("extra_options") or ())))

    for module in (kernel_sort, kernel_stage, kernel_activate, kernel_finalize, kernel_permute, sm90_kernels):
        monkeypatch.setattr(module, "launch", record)
        monkeypatch.setattr(module, "ptr", lambda tensor, align=1, row_strided=False: np.uint64(0))
    monkeypatch.setattr(sm90_kernels, "_check_device", lambda named, align: None)
    monkeypatch.setattr(executor_module, "StreamOrder", _NoOrder)
    return calls


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_the_pair_runs_the_decode_chain_with_its_mxfp8_forms(tokens: int, arch: str, recorded: list) -> None:
    """A dry run of the MXFP4 pair's call through the executor (launches recorded, every wrapper's checks on the real
    buffers): the MXFP8 tokens staged, sorted and permuted in one launch, GEMM1 quantizing to MXFP8 in its epilogue
    (SM90_ACT_MXFP8), GEMM2, both on the pair's own MXFP4 weights: prepared for SM90 its tiles (SM90_W_MXFP4), which
    take the tile handoff (buckets of at most 64 slots) and GEMM1's early routing up to four tokens as weight-only
    MXFP4 does, and at one token the route instead (the MXFP8 token staged, the routing sorted in GEMM1: two launches,
    GEMM2 with early routing); prepared for another
    arch its row-major tensors read in place (SM90_W_ROWS too: no handoff, no early routing). GEMM2 finalizes where
    the engine can. The bucket's graph chain stages the MXFP8 tokens into the bucket and sorts + permutes them from
    there."""
    pair = _pair(seed=5, arch=arch)
    tiled = arch == "sm90"
    view = grouped_view(Sm90GemmEngine, SM90, pair)
    assert view.code is (BlockCode.MXFP4 if tiled else BlockCode.MXFP4_ROWS)
    assert view.w1.data_ptr() == pair.w1_codes.data_ptr()
    engine = bare_engine()
    executor = MoeExecutor(view, engine, top_k=4, activation=SwiGLU(), local_expert_start=0, max_num_tokens=8,
                           tokens=TokenCode.MXFP8, intermediate=IntermediateCode.MXFP8)
    codes, scales = quantize_mxfp8(torch.randn(tokens, HIDDEN))
    ids = torch.stack([torch.randperm(EXPERTS)[:4] for _ in range(tokens)]).to(torch.int32)
    routing = Routing.unpacked(ids, torch.rand(tokens, 4))
    out = torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16)
    executor.run(Mxfp8Activations(codes, scales), routing, finalize=True, out=out, use_cuda_graph=False)
    names = [name for name, _ in recorded]
    gemms = [options for name, options in recorded if name == "sm90_gemm_decode"]
    routed = tiled and tokens == 1
    head = [] if routed else ["moe_stage_sort_permute_bf16_mxfp8_warp"]
    assert names[: len(head) + 2] == [*head, "sm90_gemm_decode", "sm90_gemm_decode"]
    assert names[len(head) + 2 :] in ([], ["moe_finalize"])
    assert "-DSM90_ACT_MXFP8=1" in gemms[0] and "-DSM90_ACT_MXFP8=1" not in gemms[1]
    for options in gemms:
        assert "-DSM90_W_MXFP4=1" in options and ("-DSM90_W_ROWS=1" in options) != tiled
    assert ("-DSM90_ROUTE=3" in gemms[0]) == routed and not any(o.startswith("-DSM90_ROUTE") for o in gemms[1])
    handoff = tiled and not routed
    assert ("-DSM90_SIGNAL=1" in gemms[0], "-DSM90_AWAIT=1" in gemms[1]) == (handoff, handoff)
    assert ("-DSM90_EARLY=1" in gemms[0]) == (handoff and tokens <= 4)
    assert ("-DSM90_EARLY=1" in gemms[1]) == routed  # GEMM2 behind the routed GEMM1 finds its expert early
    # The bucket's own chain (what its CUDA graph holds), behind the op's stage launch: the MXFP8 codes and scales
    # copied into the bucket, then sorted and permuted from there.
    recorded.clear()
    bucket = executor.bucket(tokens)
    executor.stage(bucket, Mxfp8Activations(codes, scales), routing)
    executor._pipeline(bucket)
    names = [name for name, _ in recorded]
    assert names[:2] == ["moe_stage_inputs", "moe_sort_permute_bf16_mxfp8"] and names.count("sm90_gemm_decode") == 2
    assert bucket.x.dtype == F8 and tuple(bucket.x_scales.shape) == (bucket.tokens, HIDDEN // 32)
