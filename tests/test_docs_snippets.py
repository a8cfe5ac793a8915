"""Every ```python block of README.md and docs/*.md runs as written.

A page is read top to bottom, so its blocks run in order in one namespace (a later block
may use the imports and models of an earlier one). What a block leaves to the reader (the
data ``x, y``, a ``loss_fn``) comes from the page's entry in ``GIVEN``: a few lines run
before the page's first block. A block that cannot run here is in ``SKIP`` with the reason;
it is still compiled, and an entry that matches no block fails, so the list stays exact.
"""
from __future__ import annotations

import pathlib
import re
from typing import Dict, List, Tuple

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

# Names a page's snippets leave to the reader, made small and cheap.
GIVEN: Dict[str, str] = {
    "docs/balance.md": (
        "import torch\n"
        "loader = [(torch.randn(8, 64), torch.randint(10, (8,)))]\n"),
    "docs/tracing.md": (
        "import torch\nfrom torch import nn\nfrom seqpipe import Pipe\n"
        "pipe = Pipe(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), chunks=4,\n"
        "            balance=[2, 1], devices=['cpu', 'cpu'])\n"
        "optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)\n"
        "loss_fn = nn.functional.cross_entropy\n"
        "batches = [(torch.randn(8, 16), torch.randint(4, (8,))) for _ in range(2)]\n"),
    "docs/skip.md": "import torch\nx = torch.randn(4, 64)\n",
    "docs/migration.md": (
        "import torch\nfrom torch import nn\nimport torch.nn.functional as F\n"
        "model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])\n"
        "sample, devices = torch.randn(4, 16), ['cpu'] * 4\n"
        "loader = [(torch.randn(8, 16), torch.randint(16, (8,)))]\n"),
}

# (page, a line of the block) -> why it does not run in this test.
_PROCESSES = "needs a process group of several ranks (torchrun); tests/test_distributed*.py"
_SCRIPT = "a whole script for two ranks: test_two_rank_scripts_run runs it"
_GPUS = "needs two GPUs (tests/test_cuda.py runs Pipe on GPUs)"
_OUTLINE = "an outline: `nn.Sequential(...)` or `...` stands for the reader's model"
SKIP: Dict[Tuple[str, str], str] = {
    ("README.md", 'devices=["cuda:0", "cuda:1"], chunks=8)  # or'): _GPUS,
    ("README.md", "pipe = DistributedPipe(model, chunks=8"): _PROCESSES,
    ("README.md", "def token_sum(logits, labels):"): _PROCESSES,
    ("README.md", "pipe = DistributedPipe(seq, chunks=8"): _PROCESSES,
    ("docs/balance.md", "model = nn.Sequential(...)"): _OUTLINE,
    ("docs/balance.md", "TransformerBlock() for _ in range(24)"): _OUTLINE,
    ("docs/balance.md", 'times = profile_times(model, sample, timeout=2.0, device="cuda:0")'):
        _OUTLINE,
    ("docs/checkpointing.md", 'save(pipe, optimizer, "ckpt/step-1000")'): _PROCESSES,
    ("docs/checkpointing.md", "gather_full_state_dict(pipe, dst=0)"): _PROCESSES,
    ("docs/checkpointing.md", "dcp.save({\"model\": model_sd"): _PROCESSES,
    ("docs/distributed.md", "# train_pipe.py"): _SCRIPT,
    ("docs/distributed.md", "pipe = DistributedPipe(model, chunks=2)"): _PROCESSES,
    ("docs/distributed.md", "from seqpipe.seeding import seed_layers"): _PROCESSES,
    ("docs/distributed.md", "loss_fn, count_fn=count_fn)"): _PROCESSES,
    ("docs/distributed.md", "batch = (x, NoChunk(bias)"): _PROCESSES,
    ("docs/distributed.md", "pipe.eval()\nout = pipe(x if pipe.is_first else None)   # the "
                            "output on the last stage, None on the others"): _PROCESSES,
    ("docs/distributed.md", "import torch.distributed.checkpoint as dcp"): _PROCESSES,
    ("docs/distributed.md", "# torchrun --nproc-per-node=2 tied.py"): _SCRIPT,
    ("docs/distributed.md", 'schedule="zbv")'): _PROCESSES,
    ("docs/distributed.md", "class ForwardOrderDrain:"): _PROCESSES,
    ("docs/distributed.md", "# torchrun --nproc-per-node=4 pp_dp.py"): _PROCESSES,
    ("docs/distributed.md", "# torchrun --nproc-per-node=2 amp.py"): _SCRIPT,
    ("docs/distributed.md", "# torchrun --nproc-per-node=4 pp_fsdp.py"): _PROCESSES,
    ("docs/distributed.md", "# torchrun --nproc-per-node=8 pp_hsdp.py"): _PROCESSES,
    ("docs/distributed.md", "# torchrun --nproc-per-node=8 pp_dp_tp.py"): _PROCESSES,
    ("docs/distributed.md", "bucket_cap_mb=4,"): _PROCESSES,
    ("docs/distributed.md", "# torchrun --nproc-per-node=4 pp_sp.py"): _PROCESSES,
    ("docs/models.md", 'model = GPT2LMHeadModel.from_pretrained("gpt2")'):
        "downloads GPT-2's weights and needs two GPUs; test_gpt2_in_five_lines runs it on a "
        "narrow GPT-2 of the same depth",
    ("docs/models.md", "model = torchvision.models.resnet50()"):
        "needs torchvision and a process group; tests/test_graph*.py convert a ResNet",
    ("docs/models.md", "model = MyModel()                                   # nothing allocated"):
        "needs a process group and the reader's model; tests/test_graph_distributed.py "
        "converts a ResNet built on meta",
    ("docs/migration.md", "fc2 = nn.Linear(8, 4).cuda(1)"): _GPUS,
    ("docs/migration.md", "deepspeed.initialize(model=net"):
        "needs DeepSpeed (the code it ports from)",
    ("docs/migration.md", "Pipe(model, chunks=8, balance=balance, devices=devices)"):
        "two alternative lines, each for the reader's unwrapped model",
    ("docs/pipe.md", 'pipe = Pipe(model, chunks=8, balance=[2, 3], devices=["cuda:0", "cuda:1"])'):
        _GPUS,
    ("docs/pipe.md", 'model[2:].to("cuda:1")'): _GPUS,
    ("docs/pipe.md", "balance=[12, 12], devices="): _GPUS,
    ("docs/pipe.md", 'loss = pipe.train_step(x, y, nn.functional.cross_entropy, schedule="1f1b")'):
        _GPUS,
    ("docs/pipe.md", "del ddp"): _SCRIPT,
    ("docs/pipe.md", "ddp.module.train_step("): _PROCESSES,
    ("docs/schedules.md", "schedule=Auto(max_live_microbatches=3)"): _PROCESSES,
}


def _blocks(page: str) -> List[Tuple[int, str]]:
    """The page's python blocks as (line number, source)."""
    text = (ROOT / page).read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)]


def _skip_entry(page: str, source: str) -> Tuple[str, str] | None:
    """The SKIP entry of a block: the one that is the whole block, else the one that is a
    line of it (an entry that is a whole block names only that block)."""
    whole = {source.strip() for _, source in _blocks(page)}
    keys = [key for key in SKIP if key[0] == page and key[1] == source.strip()]
    keys = keys or [key for key in SKIP
                    if key[0] == page and key[1] in source and key[1] not in whole]
    assert len(keys) <= 1, f"SKIP entries {keys} all match one block of {page}"
    return keys[0] if keys else None


def test_every_skip_entry_names_one_block() -> None:
    for page, line in SKIP:
        matches = [n for n, source in _blocks(page) if _skip_entry(page, source) == (page, line)]
        assert len(matches) == 1, f"SKIP entry {line!r} matches blocks {matches} of {page}"


@pytest.mark.parametrize("page", PAGES)
def test_page_snippets_run(page: str, tmp_path: pathlib.Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    namespace: Dict[str, object] = {"__name__": "__snippet__"}
    exec(compile(GIVEN.get(page, ""), f"GIVEN[{page!r}]", "exec"), namespace)
    for line, source in _blocks(page):
        code = compile("\n" * (line - 1) + source, str(ROOT / page), "exec")
        if _skip_entry(page, source) is None:
            torch.manual_seed(0)
            exec(code, namespace)


TWO_RANKS = re.compile(r"torchrun --nproc-per-node=2 (\w+\.py)")


def two_rank_scripts() -> Dict[str, Tuple[str, str]]:
    """The docs' whole scripts for two ranks (a block whose first line says ``torchrun
    --nproc-per-node=2 NAME.py``): NAME.py -> (page, source)."""
    return {m.group(1): (page, source) for page in PAGES for _, source in _blocks(page)
            if (m := TWO_RANKS.search(source.splitlines()[0]))}


def _run_scripts(rank: int, world_size: int) -> None:
    """Each script as written, in turn, on the harness's process group: its own
    ``init_process_group`` and ``destroy_process_group`` calls stand for that group's."""
    import torch.distributed as dist

    init, destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *args, **kwargs: None  # type: ignore[assignment]
    dist.destroy_process_group = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        for page, source in two_rank_scripts().values():
            torch.manual_seed(0)
            exec(compile(source, str(ROOT / page), "exec"), {"__name__": "__main__"})
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy


def test_two_rank_scripts_run() -> None:
    """distributed.md's quick start, tied weights and mixed precision scripts and pipe.md's
    ``DistributedDataParallel(Pipe)``, copied as they are, train on two ranks (one launch
    for all)."""
    from distributed_harness import run_workers

    assert sorted(two_rank_scripts()) == ["amp.py", "ddp_pipe.py", "tied.py", "train_pipe.py"]
    run_workers(_run_scripts, 2, timeout=120)


def test_gpt2_in_five_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """models.md's GPT-2 example, on the CPU and with GPT-2's twelve blocks made narrow
    (its weights are a download): it converts, its ``balance`` fits, and it trains a step."""
    from transformers import GPT2Config, GPT2LMHeadModel

    narrow = GPT2Config(n_embd=16, n_head=2, n_layer=12, vocab_size=64, n_positions=16,
                        bos_token_id=0, eos_token_id=0)
    monkeypatch.setattr(GPT2LMHeadModel, "from_pretrained",
                        classmethod(lambda cls, name: cls(narrow)))
    [source] = [source for _, source in _blocks("docs/models.md")
                if 'GPT2LMHeadModel.from_pretrained("gpt2")' in source]
    assert '["cuda:0", "cuda:1"]' in source
    ids = torch.randint(64, (2, 4))  # two micro-batches of chunks=8: a cheap step
    namespace: Dict[str, object] = {"ids": ids, "mask": torch.ones_like(ids),
                                    "labels": torch.randint(64, (2, 4))}
    exec(source.replace('["cuda:0", "cuda:1"]', '["cpu", "cpu"]'), namespace)
    assert torch.isfinite(namespace["loss"]).item()  # type: ignore[call-overload]
