"""Routing: the packed int32 format, the Routing container's validation, distinctness and EP masks."""

from __future__ import annotations

import pytest
import torch

from cudnn_moe.kernels import ROUTING_BF16, ROUTING_FP32, ROUTING_PACKED
from cudnn_moe.routing import Routing, check_distinct_experts, local_mask, pack_routing, unpack_routing


def test_bit_layout_on_hand_values() -> None:
    ids = torch.tensor([[5, -1, 0x7FFF, -0x8000]])
    weights = torch.tensor([[1.0, -2.0, 0.0, 0.5]])
    packed = pack_routing(ids, weights)
    assert packed.dtype == torch.int32
    as_unsigned = [v & 0xFFFFFFFF for v in packed[0].tolist()]
    assert as_unsigned == [0x00053F80, 0xFFFFC000, 0x7FFF0000, 0x80003F00]


def test_round_trip_bf16_exact_weights_and_negative_ids() -> None:
    torch.manual_seed(0)
    ids = torch.randint(-3, 300, (64, 6), dtype=torch.int64)
    weights = torch.randn(64, 6)
    weights[0, :3] = torch.tensor([-0.0, 3.3e38, 1e-40])  # signed zero, near BF16's max, a subnormal
    weights = weights.to(torch.bfloat16).float()
    got_ids, got_weights = unpack_routing(pack_routing(ids, weights))
    assert got_ids.dtype == torch.int32 and got_weights.dtype == torch.float32
    assert torch.equal(got_ids, ids.to(torch.int32))
    assert torch.equal(got_weights.view(torch.int32), weights.view(torch.int32))  # bit-exact, sign of zero too


def test_pack_rounds_weights_to_nearest_even_bf16() -> None:
    # 1 + 2^-8 is halfway between BF16 1.0 and 1 + 2^-7: ties to even gives 1.0; just above rounds up.
    weights = torch.tensor([[1.0 + 2**-8, 1.0 + 2**-8 + 2**-20, 1.0 + 3 * 2**-8]])
    _, got = unpack_routing(pack_routing(torch.zeros(1, 3, dtype=torch.int32), weights))
    assert got.tolist() == [[1.0, 1.0 + 2**-7, 1.0 + 4 * 2**-8]]


def test_pack_errors() -> None:
    ids, weights = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="one shape"):
        pack_routing(ids, torch.zeros(2, 3))
    with pytest.raises(TypeError, match="ids must be an integer"):
        pack_routing(weights, weights)
    with pytest.raises(TypeError, match="weights must be a floating"):
        pack_routing(ids, ids)
    with pytest.raises(ValueError, match="-32768, 32767"):
        pack_routing(torch.tensor([[40000]]), torch.zeros(1, 1))
    with pytest.raises(TypeError, match="int32"):
        unpack_routing(torch.zeros(1, 1, dtype=torch.int64))


@pytest.mark.parametrize("bad", [1e39, float("inf"), float("nan")])
def test_pack_refuses_weights_that_are_not_finite_in_bf16(bad: float) -> None:
    weights = torch.tensor([[0.5, bad]], dtype=torch.float64)
    with pytest.raises(ValueError, match="weights must be finite"):
        pack_routing(torch.zeros(1, 2, dtype=torch.int32), weights)


def test_int64_ids_outside_int32_are_refused_not_wrapped() -> None:
    routing = Routing.unpacked(torch.tensor([[2**32 + 1, -1]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="ids must lie in the int32 range"):
        routing.ids_and_weights()
    edge = torch.tensor([[2**31 - 1, -(2**31)]])
    assert Routing.unpacked(edge, torch.ones(1, 2)).ids_and_weights()[0].tolist() == edge.tolist()


def test_non_contiguous_routing_is_refused() -> None:
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="ids must be contiguous"):
        Routing.unpacked(ids.T, torch.ones(2, 4))
    with pytest.raises(ValueError, match="weights must be contiguous"):
        Routing.unpacked(ids, torch.ones(2, 4).T)
    with pytest.raises(ValueError, match="packed must be contiguous"):
        Routing.packed(torch.zeros(4, 4, dtype=torch.int32)[:, ::2])


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_unpacked_routing(id_dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    ids = torch.tensor([[3, 1], [0, 2], [1, 0]], dtype=id_dtype)
    weights = torch.tensor([[0.75, 0.25], [0.1, 0.9], [0.5, 0.5]]).to(weight_dtype)
    routing = Routing.unpacked(ids, weights)
    assert (routing.num_tokens, routing.top_k, routing.device) == (3, 2, torch.device("cpu"))
    assert not routing.is_packed
    got_ids, got_weights = routing.ids_and_weights()
    assert got_ids.dtype == torch.int32 and got_weights.dtype == torch.float32
    assert torch.equal(got_ids, ids.to(torch.int32))
    assert torch.equal(got_weights, weights.float())


def test_packed_routing_matches_unpacked_bf16() -> None:
    ids = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    weights = torch.tensor([[0.3, 0.7], [0.1, 0.9]])
    packed = Routing.packed(pack_routing(ids, weights))
    assert packed.is_packed and (packed.num_tokens, packed.top_k) == (2, 2)
    unpacked = Routing.unpacked(ids, weights.to(torch.bfloat16))
    for a, b in zip(packed.ids_and_weights(), unpacked.ids_and_weights()):
        assert torch.equal(a, b)


def test_kernel_operands() -> None:
    ids = torch.tensor([[3, 1]], dtype=torch.int64)
    weights = torch.tensor([[0.25, 0.75]])
    packed = pack_routing(ids, weights)
    operands = Routing.packed(packed).kernel_operands()
    assert operands[0] is packed and operands[1:] == (None, ROUTING_PACKED)
    assert Routing.unpacked(ids, weights).kernel_operands()[2] == ROUTING_FP32
    ids_out, weights_out, code = Routing.unpacked(ids, weights.bfloat16()).kernel_operands()
    assert ids_out is ids and weights_out.dtype == torch.bfloat16 and code == ROUTING_BF16
    assert Routing.unpacked(ids, weights).device_tensor() is ids


def test_zero_tokens_allowed() -> None:
    routing = Routing.packed(torch.zeros(0, 4, dtype=torch.int32))
    assert (routing.num_tokens, routing.top_k) == (0, 4)
    ids, weights = routing.ids_and_weights()
    assert ids.shape == weights.shape == (0, 4)
    check_distinct_experts(ids)


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: Routing.packed(torch.zeros(2, 2)), TypeError, "packed must be int32, got float32"),
        (lambda: Routing.packed([[1]]), TypeError, "packed must be a torch.Tensor"),
        (lambda: Routing.packed(torch.zeros(4, dtype=torch.int32)), ValueError, "packed must be 2-D"),
        (lambda: Routing.packed(torch.zeros(2, 0, dtype=torch.int32)), ValueError, "packed needs top_k >= 1"),
        (lambda: Routing.unpacked(torch.zeros(2, 2, dtype=torch.int16), torch.zeros(2, 2)), TypeError,
         "ids must be int32 or int64, got int16"),
        (lambda: Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.float16)),
         TypeError, "weights must be float32 or bfloat16, got float16"),
        (lambda: Routing.unpacked(torch.zeros(2, 2, 1, dtype=torch.int32), torch.zeros(2, 2)), ValueError,
         "ids must be 2-D"),
        (lambda: Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2)), ValueError,
         "weights must be 2-D"),
        (lambda: Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 3)), ValueError,
         "must have one shape"),
        (lambda: Routing.unpacked(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2, device="meta")),
         ValueError, "one device"),
        (lambda: Routing(ids=torch.zeros(1, 1, dtype=torch.int32)), ValueError, "needs both ids and weights"),
        (lambda: Routing(packed_tensor=torch.zeros(1, 1, dtype=torch.int32), weights=torch.zeros(1, 1)),
         ValueError, "not both"),
    ],
)
def test_routing_validation(build, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        build()


def test_check_distinct_experts() -> None:
    check_distinct_experts(torch.tensor([[0, 1, 2], [2, 1, 0]]))
    check_distinct_experts(torch.tensor([[-1, 4, -1]]))  # unrouted slots may repeat
    check_distinct_experts(torch.tensor([[7], [7]]))
    with pytest.raises(ValueError, match=r"token 2 names an expert more than once: ids \[5, 1, 5\]"):
        check_distinct_experts(torch.tensor([[0, 1, 2], [3, 4, 5], [5, 1, 5], [1, 1, 0]]))


def test_local_mask() -> None:
    ids = torch.tensor([[0, 3, 4], [7, 8, -1]])
    expected = torch.tensor([[False, True, True], [True, False, False]])
    assert torch.equal(local_mask(ids, local_start=3, num_local=5), expected)
