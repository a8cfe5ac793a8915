"""``Origin``: what a converted ``nn.Sequential`` remembers of the model it came from.

``to_sequential`` attaches one to the ``nn.Sequential`` it returns (``seq.origin``), and
``Pipe`` and ``DistributedPipe`` keep it (``pipe.origin``), so that

* the model's inputs, given as the model takes them, become the flat tuple a pipeline
  cuts into micro-batches (``pipeline_input``);
* the pipeline's output comes back in the model's own structure (``rebuild``: a Hugging
  Face ``ModelOutput``, a dict, a tuple...);
* a key of the converted model's ``state_dict()`` (``"3.transformer.h.0.mlp.c_fc.weight"``:
  the layer's index, then the key in the user's model) maps to the user's key and back
  (``original_key``, ``model_key``; used by ``seqpipe.distributed.checkpoint``).

It knows no engine: it is plain data about the trace.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree

__all__ = ["Origin", "model_output"]


@dataclass
class Origin:
    """How to feed a converted model and read its output (see the module doc)."""

    model_type: str
    in_spec: pytree.TreeSpec  # of (args, kwargs) as traced
    out_spec: pytree.TreeSpec  # of the model's output
    constants: Dict[int, Any]  # flat input position -> the non-tensor value traced with
    first_names: Dict[str, str]  # a tied tensor's second key in the model -> its first

    def pipeline_input(self, *args: Any, **kwargs: Any) -> Tuple[Any, ...]:
        """The model's inputs as the flat tuple the converted ``nn.Sequential`` (and a
        ``Pipe`` of it) takes: the tensors, in the order the trace saw them.

        Non-tensor arguments were fixed when tracing; they must be given again with the
        same values (or left out when they were keyword arguments), else ``ValueError``.
        """
        try:
            flat = fx_pytree.tree_flatten_spec((args, kwargs), self.in_spec)
        except Exception as exc:  # noqa: BLE001 - re-raised naming the expected structure
            raise TypeError(
                f"{self.model_type}'s converted model was traced with inputs structured as "
                f"{self.in_spec}; these inputs do not fit it ({exc}). Pass the same "
                f"arguments, by the same names, as the example") from exc
        for position, value in self.constants.items():
            if not isinstance(flat[position], torch.Tensor) and flat[position] != value:
                raise ValueError(
                    f"input {position} of {self.model_type} was traced as the constant "
                    f"{value!r} and is now {flat[position]!r}; non-tensor inputs are fixed "
                    f"by the trace: convert again with the new value")
        return tuple(flat)

    def rebuild(self, output: Any) -> Any:
        """The converted model's (or a pipeline's) flat output in the model's structure."""
        leaves: List[Any] = list(output) if isinstance(output, tuple) else [output]
        return pytree.tree_unflatten(leaves, self.out_spec)

    @staticmethod
    def original_key(key: str) -> str:
        """``"3.transformer.h.0.ln_1.weight"`` -> ``"transformer.h.0.ln_1.weight"``."""
        return key.split(".", 1)[1] if "." in key else key

    def model_key(self, key: str) -> str:
        """The key a checkpoint of the user's model keeps for ``key`` of the converted one:
        its original key, or for a tensor with several names there (tied weights), the
        first of them (as the user's own ``state_dict()`` lists them)."""
        original = self.original_key(key)
        return self.first_names.get(original, original)


def model_output(origin: Optional[Origin], output: Any) -> Any:
    """A pipeline's ``output`` in the structure of the model its module was converted
    from (``origin``); unchanged for a model written as an ``nn.Sequential`` (``origin``
    None) and for a rank without output (``None``)."""
    return output if origin is None or output is None else origin.rebuild(output)
