"""CPU tests of the low-latency fallback for calls above max_num_tokens (cudnn_moe.low_latency.fallback):
preparation (the same payloads bit for bit in the SM90 engine's layout, or the caller's fused view checked
bit for bit), which formats and GPUs get one, which path a call takes, and bad inputs refused before any
launch. The op's GPU-only steps (device check, GPU arch, the launches) are replaced by recorders where a
test follows a call past them; the GPU runs are test_low_latency_fallback_gpu.py."""

from __future__ import annotations

import importlib

import pytest
import torch

from cudnn_moe.activations import SiLU, SwiGLU
from cudnn_moe.engines.cuda_cores.engine import CudaCoresEngine
from cudnn_moe.engines.sm90.engine import Sm90GemmEngine
from cudnn_moe.fused.config import Nvfp4MoeConfig
from cudnn_moe.low_latency import LowLatencyFallback, LowLatencyMoeConfig, WeightFormat, grouped, low_latency_moe
from cudnn_moe.low_latency.fallback import fallback_for_call
from cudnn_moe.routing import Routing
from tests.ops.low_latency.test_low_latency_cpu import (
    IP, PAIR_H, PAIR_I, block_payloads, dense_weights, prepare, same_bits,
)
from tests.support.low_latency import NullWorkspace

op_module = importlib.import_module("cudnn_moe.low_latency.op")
NVFP4_WO, PAIR = WeightFormat.NVFP4_WEIGHT_ONLY, WeightFormat.NVFP4_W_NVFP4_A
LL_MAX, FUSED_MAX = 2, 64


def ll_config(arch: str = "sm90") -> LowLatencyMoeConfig:
    return LowLatencyMoeConfig(LL_MAX, arch=arch)


def fused_config(arch: str = "sm90", max_num_tokens: int = FUSED_MAX, engine: str = "auto") -> Nvfp4MoeConfig:
    return Nvfp4MoeConfig(arch=arch, max_num_tokens=max_num_tokens, engine=engine)


def weight_only(gated: bool = True, arch: str = "sm90"):
    """NVFP4 weight-only weights, E = 3, H = 128, I = 96 (padded to 128)."""
    return prepare(ll_config(arch), NVFP4_WO, block_payloads(NVFP4_WO, gated), SwiGLU() if gated else SiLU())


def pair_sources(seed: int = 0, experts: int | None = None, hidden: int = PAIR_H):
    w1, w2 = dense_weights(torch.bfloat16, True, seed=seed, hidden=hidden, inter=PAIR_I)
    return (w1[:experts], w2[:experts]) if experts else (w1, w2)


def pair(arch: str = "sm90"):
    return ll_config(arch).prepare_nvfp4_weights(*pair_sources())


# ----------------------------------------------------------------------------- preparation
@pytest.mark.parametrize("gated", [True, False])
def test_weight_only_fallback_holds_the_same_payloads_in_the_sm90_layout(gated):
    weights = weight_only(gated)
    with_fallback = ll_config().prepare_fallback(weights, fused_config())
    assert weights.fallback is None  # the caller's record is not changed
    assert type(with_fallback) is type(weights) and with_fallback.w1_codes is weights.w1_codes
    fallback = with_fallback.fallback
    assert isinstance(fallback, LowLatencyFallback) and fallback.config.max_num_tokens == FUSED_MAX
    view = fallback.weights
    assert view.spec.engine == "sm90" and view.spec.arch == (9, 0)
    assert (view.hidden_size, view.intermediate_size, view.gated, view.num_experts) == (128, IP, gated, 3)
    # SM90 weights are stored as the engine's tiles: the view holds their memory (no copy)
    assert weights.tiled and view.w1.data_ptr() == weights.w1_codes.data_ptr()
    assert view.w2_scales.data_ptr() == weights.w2_scales.data_ptr()
    w1, w1_scales, w2, w2_scales = view.canonical()  # the padded payloads, zero padding included, bit for bit
    w1_codes, w1_rows, w2_codes, w2_rows = weights.row_payloads()
    for got, want in ((w1, w1_codes), (w1_scales, w1_rows), (w2, w2_codes), (w2_scales, w2_rows),
                      (view.w1_alpha, weights.w1_global), (view.w2_alpha, weights.w2_global)):
        assert same_bits(got, want)
    assert all(same_bits(a, b) for a, b in zip(with_fallback.canonical(), weights.canonical()))


def test_pair_fallback_accepts_the_callers_fused_view_of_the_same_layer():
    """prepare_nvfp4_weights and Nvfp4MoeConfig.prepare_weights quantize alike: the caller's fused weights are used
    as they are (no repacked copy)."""
    weights = pair()
    fused = fused_config().prepare_weights(*pair_sources())
    with_fallback = ll_config().prepare_fallback(weights, fused_config(), fused_weights=fused)
    assert with_fallback.fallback.weights is fused
    repacked = ll_config().prepare_fallback(weights, fused_config()).fallback.weights
    assert all(same_bits(a, b) for a, b in zip(repacked.canonical(), fused.canonical()))


def test_pair_tokens_above_max_num_tokens_come_from_the_fused_configs_quantizer():
    """The fused config quantizes tokens exactly as the low-latency config does (global one), and takes more."""
    x = torch.randn(LL_MAX, PAIR_H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ll, fused = ll_config().prepare_nvfp4_activations(x), fused_config().prepare_activations(x)
    assert same_bits(ll.packed, fused.packed) and same_bits(ll.scales, fused.scales)
    assert fused_config().prepare_activations(torch.zeros(FUSED_MAX, PAIR_H)).num_tokens == FUSED_MAX


def test_tensor_core_path_reuses_the_fallback_view(monkeypatch):
    """On SM90, calls of up to 8 tokens (grouped.layer_view) take the fallback's view: no second repack."""
    monkeypatch.setattr(grouped, "device_arch", lambda device: (9, 0))
    weights = ll_config().prepare_fallback(weight_only(), fused_config())
    assert grouped.layer_view(Sm90GemmEngine, weights) is weights.fallback.weights


@pytest.mark.parametrize("fmt", [f for f in WeightFormat if f not in (NVFP4_WO, PAIR)])
def test_other_formats_get_no_fallback(fmt):
    weights = prepare(ll_config(), fmt, block_payloads(fmt, True)) if fmt not in (WeightFormat.BF16, WeightFormat.FP16) \
        else prepare(ll_config(), fmt, dense_weights(torch.bfloat16 if fmt is WeightFormat.BF16 else torch.float16, True))
    with pytest.raises(ValueError, match=f"weights: {fmt.value} weights have no fallback"):
        ll_config().prepare_fallback(weights, fused_config())


@pytest.mark.parametrize("make", [weight_only, pair], ids=["weight_only", "pair"])
def test_blackwell_gets_no_fallback(make):
    """cuDNN's NVFP4 GEMMs read NVFP4 tokens: the fused pipeline there requantizes the intermediate."""
    with pytest.raises(ValueError, match="whose GEMMs read NVFP4 tokens.*no exact fallback"):
        ll_config("sm100").prepare_fallback(make("sm100"), fused_config("sm100"))


# ----------------------------------------------------------------------------- which path a call takes
def _call_args(weights, tokens: int, x_dtype=torch.bfloat16):
    if weights.format is PAIR:
        x = fused_config().prepare_activations(torch.randn(tokens, weights.hidden_size))
    else:
        x = torch.randn(tokens, weights.hidden_size).to(x_dtype)
    ids = torch.stack([torch.randperm(weights.num_experts)[:2] for _ in range(tokens)]).to(torch.int32)
    return x, Routing.unpacked(ids, torch.rand(tokens, 2))


class Recorder:
    """Stands in for the GPU steps of a call (device check, GPU arch, launches): records which path ran."""

    def __init__(self, monkeypatch, arch=(9, 0)) -> None:
        self.runs: list[tuple] = []
        monkeypatch.setattr(op_module, "check_devices", lambda x, ids, weights: x.device)
        monkeypatch.setattr(op_module, "device_arch", lambda device: arch)
        monkeypatch.setattr(op_module, "workspace_for", lambda *args: NullWorkspace)
        monkeypatch.setattr(CudaCoresEngine, "run", classmethod(
            lambda cls, call, buffers: self.runs.append(("low_latency", cls.name, call))))
        monkeypatch.setattr(grouped, "run", lambda engine, call: self.runs.append(("low_latency", engine.name, call)))
        monkeypatch.setattr(grouped, "run_on", lambda view, call, max_tokens: self.runs.append(
            ("fallback", view, call, max_tokens)))


@pytest.mark.parametrize("make, engine", [(weight_only, "cuda_cores"), (pair, "sm90")], ids=["weight_only", "pair"])
@pytest.mark.parametrize("tokens", [1, LL_MAX, LL_MAX + 1, 17, FUSED_MAX])
def test_calls_above_max_num_tokens_take_the_fallback(monkeypatch, make, engine, tokens):
    """At or below max_num_tokens the registry's engine runs the call (weight-only I = 96: the CUDA cores; the pair:
    the SM90 tensor cores), above it the fallback's view with its token limit."""
    weights = ll_config().prepare_fallback(make(), fused_config())
    recorder = Recorder(monkeypatch)
    x, routing = _call_args(weights, tokens)
    out = low_latency_moe(ll_config(), x, weights, routing)
    assert out.shape == (tokens, weights.hidden_size) and out.dtype == torch.bfloat16
    [run] = recorder.runs
    if tokens <= LL_MAX:
        assert run[:2] == ("low_latency", engine)
    else:
        assert run[0] == "fallback" and run[1] is weights.fallback.weights and run[3] == FUSED_MAX
        assert run[2].out is out and run[2].tokens == tokens


def test_calls_within_max_num_tokens_keep_their_engine(monkeypatch):
    """A fallback changes nothing at or below max_num_tokens: FP16 and raw rows still run there."""
    weights = ll_config().prepare_fallback(weight_only(), fused_config())
    recorder = Recorder(monkeypatch)
    x, routing = _call_args(weights, LL_MAX, torch.float16)
    low_latency_moe(ll_config(), x, weights, routing, out_dtype=torch.float16)
    x, routing = _call_args(weights, LL_MAX)
    low_latency_moe(ll_config(), x, weights, routing, finalize=False)
    assert [run[:2] for run in recorder.runs] == [("low_latency", "cuda_cores")] * 2
    assert [run[2].out_dtype for run in recorder.runs] == [torch.float16, torch.bfloat16]
    assert not recorder.runs[1][2].finalize


def test_fallback_of_another_gpu_is_refused_before_any_launch(monkeypatch):
    weights = ll_config().prepare_fallback(weight_only(), fused_config())
    recorder = Recorder(monkeypatch, arch=(10, 0))
    x, routing = _call_args(weights, LL_MAX + 1)
    with pytest.raises(ValueError, match="weights.fallback was prepared for the sm90 engine on sm90 but this GPU is sm100"):
        low_latency_moe(ll_config(), x, weights, routing)
    assert recorder.runs == []


def test_out_may_not_alias_the_fallback_view(monkeypatch):
    """The caller's fused view of the layer (its own memory; a repacked fallback shares the weights' tiles, which the
    weights' own check covers)."""
    weights = ll_config().prepare_fallback(pair(), fused_config(), fused_weights=fused_config().prepare_weights(
        *pair_sources()))
    recorder = Recorder(monkeypatch)
    x, routing = _call_args(weights, LL_MAX + 1)
    shape = (LL_MAX + 1, weights.hidden_size)
    alias = weights.fallback.weights.w1.view(torch.bfloat16).flatten()[: shape[0] * shape[1]].view(shape)
    with pytest.raises(ValueError, match="weights.fallback tensor 0"):
        low_latency_moe(ll_config(), x, weights, routing, out=alias)
    assert recorder.runs == []


def test_without_a_fallback_the_error_stays_and_says_what_to_do():
    x, routing = _call_args(weight_only(), LL_MAX + 1)
    with pytest.raises(ValueError, match=r"hold 3 tokens, more than the config's max_num_tokens=2; prepare a fallback "
                                         r"for larger calls with config.prepare_fallback\(weights, Nvfp4MoeConfig"):
        low_latency_moe(ll_config(), x, weight_only(), routing)
    bf16 = prepare(ll_config(), WeightFormat.BF16, dense_weights(torch.bfloat16, True))
    x, routing = _call_args(bf16, LL_MAX + 1)
    with pytest.raises(ValueError, match="max_num_tokens=2; bf16 weights have no fallback"):
        low_latency_moe(ll_config(), x, bf16, routing)


def test_a_fallback_call_on_cpu_tensors_gets_past_the_size_checks():
    """Nothing stubbed: the call is refused by the device check, after the fallback accepted it."""
    weights = ll_config().prepare_fallback(weight_only(), fused_config())
    x, routing = _call_args(weights, LL_MAX + 1)
    with pytest.raises(ValueError, match="runs on a CUDA device"):
        low_latency_moe(ll_config(), x, weights, routing)


def test_fallback_for_call_decides_by_token_count():
    weights = ll_config().prepare_fallback(weight_only(), fused_config())
    bf16 = torch.bfloat16
    assert fallback_for_call(LL_MAX, weights, LL_MAX, bf16, bf16, True) is None
    assert fallback_for_call(LL_MAX, weights, LL_MAX, torch.float16, torch.float16, False) is None
    assert fallback_for_call(LL_MAX, weights, LL_MAX + 1, bf16, bf16, True) is weights.fallback
    assert fallback_for_call(LL_MAX, weights, FUSED_MAX, bf16, bf16, True) is weights.fallback


# ----------------------------------------------------------------------------- bad inputs
def _call_bad(tokens: int = LL_MAX + 1, x_dtype=torch.bfloat16, **kwargs):
    def call():
        weights = ll_config().prepare_fallback(weight_only(), fused_config())
        x, routing = _call_args(weights, tokens, x_dtype)
        low_latency_moe(ll_config(), x, weights, routing, **kwargs)
    return call


def _prep_bad(weights=None, config=None, fused_weights=None, ll=None):
    return lambda: (ll or ll_config()).prepare_fallback(weights if weights is not None else pair(),
                                                        config if config is not None else fused_config(),
                                                        fused_weights=fused_weights)


def _fused(**change):
    """The caller's fused weights of another layer (or the same layer, for the config changes)."""
    args = {"seed": 0, "experts": None, "hidden": PAIR_H, **change}
    config = fused_config(engine=args.pop("engine", "auto"))
    return config.prepare_weights(*pair_sources(**args))


def _not_gated_fused():
    w1, w2 = pair_sources()
    return fused_config().prepare_weights(w1[:, :PAIR_I], w2, activation=SiLU())


def _split_alpha_fused():
    from dataclasses import replace
    fused = _fused()
    return replace(fused, w1_alpha=torch.cat((fused.w1_alpha, fused.w1_alpha)), w1_alpha_split=PAIR_I)


def _flipped_scale_fused():
    fused = _fused()
    fused.w2_scales.view(torch.uint8).view(-1)[5] ^= 1
    return fused


BAD_INPUTS = [
    ("call above the fallback's max", _call_bad(tokens=FUSED_MAX + 1), ValueError, f"hold {FUSED_MAX + 1} tokens, more than the fallback's max_num_tokens={FUSED_MAX}"),
    ("raw rows above max", _call_bad(finalize=False), ValueError, "the fallback returns finalized outputs only, so finalize=False takes at most 2 tokens"),
    ("raw rows with scores above max", _call_bad(finalize=False, return_scores=True), ValueError, "finalize=False takes at most 2"),
    ("fp16 output above max", _call_bad(out_dtype=torch.float16), ValueError, "the fallback writes BF16 outputs only"),
    ("fp16 tokens above max", _call_bad(x_dtype=torch.float16), ValueError, "the fallback takes BF16 tokens only"),
    ("weights not prepared", _prep_bad(weights=torch.zeros(3)), TypeError, "weights must be prepared by LowLatencyMoeConfig"),
    ("fused_config type", _prep_bad(config=LowLatencyMoeConfig(8)), TypeError, "fused_config must be an Nvfp4MoeConfig"),
    ("fused_config max below the call", _prep_bad(config=fused_config(max_num_tokens=LL_MAX)), ValueError, "fused_config.max_num_tokens=2 must exceed the low-latency config's max_num_tokens=2"),
    ("fused_config another arch", _prep_bad(config=fused_config("sm100")), ValueError, "fused_config prepares for sm100 but the low-latency config for sm90"),
    ("fused_config cudnn on sm90", _prep_bad(config=fused_config(engine="cudnn")), ValueError, "picks the cudnn engine on sm90, whose GEMMs read NVFP4 tokens"),
    ("fused_weights type", _prep_bad(fused_weights=pair()), TypeError, "fused_weights must be Nvfp4Weights"),
    ("fused_weights of another layout", _prep_bad(fused_weights=_fused(engine="cudnn")), ValueError, "fused_weights are laid out for the cudnn engine on sm90 but fused_config picks the sm90 engine"),
    ("fused_weights expert count", _prep_bad(fused_weights=_fused(experts=2)), ValueError, "fused_weights hold 2 experts but weights hold 3"),
    ("fused_weights another shape", _prep_bad(fused_weights=_fused(hidden=2 * PAIR_H)), ValueError, "fused_weights are a layer of H=1024, I=128 but weights have H=512"),
    ("fused_weights not gated", _prep_bad(fused_weights=_not_gated_fused()), ValueError, "fused_weights are not gated but weights are gated"),
    ("fused_weights split alpha", _prep_bad(fused_weights=_split_alpha_fused()), ValueError, "one global per expert and GEMM"),
    ("fused_weights another layer", _prep_bad(fused_weights=_fused(seed=1)), ValueError, "fused_weights.w1 is not bit for bit"),
    ("fused_weights one scale off", _prep_bad(fused_weights=_flipped_scale_fused()), ValueError, "fused_weights.w2_scales is not bit for bit"),
]


@pytest.mark.parametrize("call, error, match", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()
