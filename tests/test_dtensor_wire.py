"""How a ``DTensor`` crossing a stage boundary is described on the wire
(``seqpipe.distributed.dtensor_wire``), in one process; the crossing itself, between
processes, is tested by ``sequence_parallel_cases`` in ``test_tensor_parallel``'s launch."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from seqpipe.distributed.dtensor_wire import Crossing, _Description, check_mesh
from seqpipe.distributed.wire import Kind, Message


def test_a_description_reads_back_as_written() -> None:
    """Mesh names, sizes, coordinate, each kind of placement, global shape and stride."""
    described = _Description(("dp", "tp"), (2, 4), (1, 3),
                             (Shard(1), Replicate(), Partial("sum")), (8, 6, 16), (96, 16, 1))
    text = described.text()
    assert _Description.parse(text) == described
    assert text == "dp,tp|2,4|1,3|S1,R,Psum|8,6,16|96,16,1"


def test_a_placement_the_wire_does_not_carry_is_refused_by_name() -> None:
    described = _Description(("tp",), (2,), (0,), (_StridedShard(0, split_factor=2),),
                             (8, 4), (4, 1))
    with pytest.raises(TypeError, match="only Shard, Replicate and Partial placements"):
        described.text()


def test_mesh_must_be_a_device_mesh() -> None:
    assert check_mesh(None) is None
    with pytest.raises(TypeError, match="mesh must be a torch.distributed.device_mesh"):
        check_mesh("tp")


def test_plain_messages_pass_unchanged() -> None:
    """Without a DTensor, the tensors, values and message are the very objects given."""
    crossing, name = Crossing({}, None), (lambda rank: f"stage {rank}")
    tensors, values = [torch.ones(2)], ((0, 3),)
    assert crossing.outgoing(Kind.ACTIVATION, 0, -1, 0, tensors, [True], values, name) == (
        tensors, values)
    assert crossing.outgoing(Kind.GRAD, 0, -1, 1, tensors, None, (), name) == (tensors, ())
    message = Message(Kind.ACTIVATION, 0, -1, (torch.ones(2),), (True,), values=values)
    assert crossing.incoming(message, 0, name) is message
