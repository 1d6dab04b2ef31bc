"""benchmarks/int4_peer.py on the CPU: the INT4 weights in the kernel's layout (two codes a byte along K, the even k in
the low nibble, a BF16 scale per group), the float32 reference on them, and the layer composed from FlagGems' parts
with torch stand-ins for the kernels that follow the kernels' indexing (a slot's row is slot // top_k): the
composition must give the reference; a peer whose output misses it is not timed, and one that fails is reported."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402
import int4_peer  # noqa: E402

GROUP = int4_peer.GROUP
EXPERTS, HIDDEN, INTER, TOKENS, TOP_K = 6, 2 * GROUP, GROUP, 3, 2


def test_codes_pack_two_a_byte_along_k_with_a_scale_per_group() -> None:
    w = torch.zeros(1, 2, 2 * GROUP)
    w[0, 0, :GROUP] = torch.linspace(-7, 7, GROUP)  # scale 1: every integer code once at least
    w[0, 0, GROUP:] = 0.5 * torch.linspace(-7, 7, GROUP)  # scale 0.5
    w[0, 1, 0], w[0, 1, 1] = -3.5, 3.5  # row 1, group 0: scale 0.5, codes -7 and 7; group 1 all zero
    codes, scales = int4_peer.quantize_int4(w.to(torch.bfloat16))
    assert codes.shape == (1, 2, GROUP) and codes.dtype == torch.uint8
    assert scales.shape == (1, 2, 2) and scales.dtype == torch.bfloat16
    assert scales.float().tolist() == [[[1.0, 0.5], [0.5, 1.0]]]  # amax / 7; an all-zero group keeps 1
    assert int(codes[0, 1, 0]) == (8 - 7) | ((8 + 7) << 4)  # k = 0 in the low nibble, k = 1 in the high one
    assert bool((codes[0, 1, GROUP // 2:] == 8 | (8 << 4)).all())  # zeros are code 8
    back = int4_peer.dequantize_int4(codes, scales)
    want = w.to(torch.bfloat16).float()
    assert torch.equal(back[0, 1], want[0, 1])
    assert float((back - want).abs().max()) <= 0.5 * 1.0 + 1e-6  # within half a step of its group
    assert float((back[0, 0, GROUP:] - want[0, 0, GROUP:]).abs().max()) <= 0.25 + 1e-6


def test_quantize_refuses_k_off_the_group() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        int4_peer.quantize_int4(torch.zeros(1, 2, GROUP + 2, dtype=torch.bfloat16))


def _weights(gen: torch.Generator) -> tuple[int4_peer.Int4Tensor, int4_peer.Int4Tensor]:
    w1 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen).to(torch.bfloat16)
    return int4_peer.quantize_int4(w1, chunk=4), int4_peer.quantize_int4(w2, chunk=4)


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)]).to(torch.int32)
    return x, ids, torch.softmax(torch.randn(TOKENS, TOP_K, generator=gen), 1)


def test_reference_is_the_layer_on_the_dequantized_weights() -> None:
    gen = torch.Generator().manual_seed(3)
    w1, w2 = _weights(gen)
    x, ids, route_w = _batch(gen)
    got = int4_peer.reference_layer(x, ids, route_w, w1, w2)
    for t in range(TOKENS):
        want = torch.zeros(HIDDEN)
        for s in range(TOP_K):
            e = int(ids[t, s])
            h = int4_peer.dequantize_int4(*[part[e] for part in w1]) @ x[t].float()
            act = F.silu(h[:INTER]) * h[INTER:]
            want += route_w[t, s] * (int4_peer.dequantize_int4(*[part[e] for part in w2]) @ act)
        torch.testing.assert_close(got[t], want, rtol=1e-4, atol=1e-3)  # float32, another order


def _torch_parts(log: list[tuple]) -> int4_peer.Parts:
    """Stand-ins for FlagGems' parts: align keeps the slots in order (sorted ids = the slots, expert ids = their
    experts); the GEMM computes each slot's row as the kernel indexes it (A's row slot // top_k, B the slot's expert,
    times the route weight where asked), in float32 rounded to BF16 like the kernel's output."""

    def config(w1_shape, w2_shape, top_k, dtype, tokens, experts, block):  # noqa: ANN001, ANN202
        log.append(("config", tuple(w1_shape), tuple(w2_shape), top_k, dtype, tokens, experts, tuple(block)))
        return {"BLOCK_SIZE_M": 16}

    def align(ids, block_m, experts):  # noqa: ANN001, ANN202
        return torch.arange(ids.numel(), dtype=torch.int32), ids.flatten(), None

    def gemm(a, b, c, b_scale, b_zp, route_w, sorted_ids, expert_ids, padded, mul_routed, top_k, config, compute,
             int8, int4, block):  # noqa: ANN001, ANN202
        log.append(("gemm", mul_routed, top_k, int8, int4, tuple(block), b_zp, config.get("SPLIT_K")))
        flat = c.view(-1, c.shape[-1])
        for slot, expert in zip(sorted_ids.tolist(), expert_ids.tolist()):
            row = a[slot // top_k].float() @ int4_peer.dequantize_int4(b[expert], b_scale[expert]).T
            flat[slot] = (row * route_w.flatten()[slot] if mul_routed else row).to(torch.bfloat16)

    def activation(out, h):  # noqa: ANN001, ANN202
        half = out.shape[1]
        out.copy_((F.silu(h[:, :half].float()) * h[:, half:].float()).to(torch.bfloat16))

    def total(rows, out):  # noqa: ANN001, ANN202
        out.copy_(rows.float().sum(1).to(out.dtype))

    return int4_peer.Parts(config, align, gemm, activation, total, "bf16")


def _peer(monkeypatch: pytest.MonkeyPatch, report: common.Report, parts: int4_peer.Parts | None,
          version: str = "0.0-test") -> int4_peer.Int4Peer:
    """An Int4Peer whose FlagGems parts are ``parts`` (None: flag_gems did not import, ``version`` says why)."""
    monkeypatch.setattr(int4_peer, "load_parts", lambda: (parts, version))
    return int4_peer.Int4Peer(report)


def _timer() -> SimpleNamespace:
    return SimpleNamespace(median_us=lambda fn: (fn(), 42.0)[1])


@pytest.fixture
def no_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int4_peer, "capture", lambda fn: SimpleNamespace(replay=fn))


def test_the_composed_layer_matches_the_reference_and_is_timed(no_capture: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(5)
    log: list[tuple] = []
    report = common.Report()
    peer = _peer(monkeypatch, report, _torch_parts(log))
    w1 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen).to(torch.bfloat16)
    peer.prepare(w1, w2)
    x, ids, route_w = _batch(gen)
    got = int4_peer.int4_layer(peer.parts, x, ids, route_w, *peer.weights).float()
    want = int4_peer.reference_layer(x, ids, route_w, *peer.weights)
    assert float((got - want).abs().max() / want.abs().max()) <= int4_peer.MAX_ERROR
    # the lookup sees the packed shapes and the batch; GEMM1 keeps its slots' rows, GEMM2 takes the route weight
    assert log[0] == ("config", (EXPERTS, 2 * INTER, HIDDEN // 2), (EXPERTS, HIDDEN, INTER // 2), TOP_K, "int4_w4a16",
                      TOKENS, EXPERTS, (0, GROUP))
    # (the FlagGems kernel takes a SPLIT_K that its launcher does not set: the layer passes 1)
    assert log[1:3] == [("gemm", False, TOP_K, False, True, (0, GROUP), None, 1),
                        ("gemm", True, 1, False, True, (0, GROUP), None, 1)]
    assert peer.time_us(_timer(), x, ids.long(), route_w) == (42.0, common.fmt(42.0))
    assert any("INT4 peer: FlagGems 0.0-test" in note for note in report.notes)


def test_a_peer_off_the_reference_is_not_timed(no_capture: None, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(7)
    parts = _torch_parts([])
    wrong = int4_peer.Parts(parts.config, parts.align, parts.gemm, lambda out, h: out.copy_(h[:, out.shape[1]:]),
                            parts.sum, parts.compute_type)  # no SiLU-and-mul
    report = common.Report()
    peer = _peer(monkeypatch, report, wrong)
    peer.prepare(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen).to(torch.bfloat16),
                 torch.randn(EXPERTS, HIDDEN, INTER, generator=gen).to(torch.bfloat16))
    assert peer.time_us(_timer(), *_batch(gen)) == (None, "wrong")
    assert any("off the float32 reference" in note and "not timed" in note for note in report.notes)


def test_a_failing_peer_is_reported_and_a_missing_one_leaves_the_column_empty(
        no_capture: None, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(9)
    parts = _torch_parts([])

    def broken(*args: object) -> None:
        raise RuntimeError("out of resources: shared memory")

    report = common.Report()
    peer = _peer(monkeypatch, report, int4_peer.Parts(parts.config, parts.align, broken, parts.activation, parts.sum,
                                                      parts.compute_type))
    peer.prepare(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen).to(torch.bfloat16),
                 torch.randn(EXPERTS, HIDDEN, INTER, generator=gen).to(torch.bfloat16))
    us, cell = peer.time_us(_timer(), *_batch(gen))
    assert us is None and cell != "-" and any("shared memory" in note for note in report.notes)
    missing = _peer(monkeypatch, common.Report(), None, "No module named 'flag_gems'")
    missing.prepare(torch.zeros(1, 2, GROUP, dtype=torch.bfloat16), torch.zeros(1, GROUP, 1, dtype=torch.bfloat16))
    assert missing.weights is None and missing.time_us(_timer(), *_batch(gen)) == (None, "-")
