"""Glue whose behaviour depends on train/eval mode: dropout follows the layer's unit.

``torch.export`` records ``F.dropout(x, p, self.training)`` in a parent's ``forward``
(BART's encoder and decoder, after the embeddings) as ``aten.dropout(x, p, True)``: the
mode at conversion, frozen. A converted layer instead reads the ``training`` flag of its
own unit (the user's module object, which ``model.train()``/``model.eval()`` and
``seq.train()``/``seq.eval()`` both reach) each time it runs, so dropout in the glue is
on in train mode and off in eval mode, as in the model. Other train/eval-dependent ops in
the glue (a functional batch norm, a bare ``bernoulli``) are refused by ``to_sequential``.
"""
from __future__ import annotations

import torch

__all__ = ["FOLLOWS_MODE", "REFUSED_MODE_OPS", "MODE_ARG"]

_aten = torch.ops.aten

# ops of the form (input, p, train) whose ``train`` argument a layer sets from its unit
FOLLOWS_MODE = frozenset({_aten.dropout.default, _aten.feature_dropout.default,
                          _aten.alpha_dropout.default, _aten.feature_alpha_dropout.default})
MODE_ARG = 2  # the position of ``train``

# words in the names of the other ops whose behaviour the trace would freeze
REFUSED_MODE_OPS = ("dropout", "batch_norm", "bernoulli")
