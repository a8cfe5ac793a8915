"""docs/api.md lists every public name: each name in the public modules' ``__all__``."""
from __future__ import annotations

import importlib
import pathlib
import re

import pytest

PUBLIC = ["seqpipe", "seqpipe.graph", "seqpipe.distributed", "seqpipe.distributed.checkpoint",
          "seqpipe.skip", "seqpipe.balance", "seqpipe.schedule", "seqpipe.seeding",
          "seqpipe.batchnorm", "seqpipe.launch", "seqpipe.compat.torchgpipe",
          "seqpipe.compat.torch_pipe", "seqpipe.trace"]
PAGE = (pathlib.Path(__file__).parent.parent / "docs" / "api.md").read_text(encoding="utf-8")


def _section(module: str) -> str:
    """The text under the module's heading (up to the next heading), or its table row."""
    heading = re.search(rf"^#+ `{re.escape(module)}`\n(.*?)(?=^#|\Z)", PAGE, re.M | re.S)
    if heading:
        return heading.group(1)
    row = re.search(rf"^\| `{re.escape(module)}` \|(.*)$", PAGE, re.M)
    assert row, f"docs/api.md has no section or row for {module}"
    return row.group(1)


@pytest.mark.parametrize("module", PUBLIC)
def test_every_public_name_is_on_the_api_page(module: str) -> None:
    text = _section(module)
    names = importlib.import_module(module).__all__
    missing = [n for n in names if not re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", text)]
    assert not missing, f"docs/api.md does not list {missing} under {module}"
