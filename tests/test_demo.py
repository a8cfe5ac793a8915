"""``python -m seqpipe``: its command line, and one short run of each engine."""
from __future__ import annotations

import json
import pathlib
import xml.etree.ElementTree as ET

import pytest

from seqpipe.demo import main, make_data, parse_args


@pytest.mark.parametrize(("argv", "message"), [
    (["--chunks", "0"], "argument --chunks: must be at least 1, got 0"),
    (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["--processes", "0"], "argument --processes: must be at least 1, got 0"),
    (["--processes", "-1"], "argument --processes: must be at least 1, got -1"),
    (["--processes", "25"], "--processes 25: with --schedule 1f1b that is 25 stages, but the "
                            "demo model has 20 layers, so at most 20"),
    (["--partitions", "2", "--processes", "2"], "--partitions is for the local Pipe"),
    (["--schedule", "auto"], "--schedule auto measures the first step and picks a schedule, "
                             "which only DistributedPipe does: add --processes N"),
    (["--processes", "11", "--schedule", "zbv"], "--processes 11: with --schedule zbv that "
                                                 "is 22 stages, but the demo model has 20"),
])
def test_bad_options_get_one_line_errors(argv: list, message: str,
                                         capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert message in lines[-1] and lines[-1].startswith("python -m seqpipe: error:")


def test_help_shows_every_option_with_its_default(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--steps", "--batch", "--chunks", "--partitions", "--checkpoint",
                   "--balance-by", "--lr", "--seed", "--processes", "--schedule", "--trace"):
        assert option in text, option
    assert "(default: 30)" in text and "(default: except_last)" in text
    assert "(default: None)" not in text  # --partitions, --processes, --trace say it in words
    assert "(default: the GPUs, or 2 on CPU)" in text and "(default: size)" in text
    schedules = text.split("--schedule {", 1)[1].split("}", 1)[0].split(",")
    assert schedules == ["fill_drain", "1f1b", "zb_h1", "zb_h2", "interleaved_1f1b",
                         "looped_bfs", "interleaved_zb", "zbv", "dualpipev", "auto"]


def test_data_is_made_step_by_step() -> None:
    data = make_data(10**9, 4)  # a generator: nothing is made up front
    images, labels = next(data)
    assert images.shape == (4, 3, 32, 32) and labels.shape == (4,)


def test_local_run_trains_and_shows_the_clock(capsys: pytest.CaptureFixture) -> None:
    loss = main(["--steps", "3", "--batch", "8", "--balance-by", "params"])
    out = capsys.readouterr().out
    assert loss == loss  # a number, not NaN
    assert "partition 0 on cpu:" in out and "partition 1 on cpu:" in out
    assert "schedule '1f1b', 2 stages x 4 micro-batches" in out and "bubble 20%" in out
    assert "thread 0: F0 F1 " in out and "thread 1: .  F0 B0 " in out  # no ranks here
    assert "samples/s (running average)" in out and "samples/s pipelined; final loss " in out
    assert "  unpipelined,  4 micro-batches " in out
    assert "(checkpoint='except_last': the pipeline's work without the pipeline)" in out
    assert "the pipelined step takes " in out and "nan" not in out
    assert out.strip().splitlines()[-1].startswith("trace: 1 step, ")  # the last step's


def test_on_cpu_the_demo_says_why_the_pipeline_is_slower(capsys: pytest.CaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The report gives the median steps, splits the pipelined one's ratio into the work
    the settings ask for and the pipeline's own; two ``cpu`` partitions share the cores
    the unpipelined model's intra-op threads already use: the demo says so, and not when
    there is one thread."""
    import torch
    from torch import nn

    from seqpipe.demo_baseline import Beside

    args = parse_args(["--chunks", "2", "--checkpoint", "never", "--batch", "32"])
    beside = Beside(nn.Linear(2, 2), torch.device("cpu"), args, torch.optim.SGD, nn.MSELoss())
    beside.times = {"whole": [0.02, 0.01, 0.02], "same": [0.025, 0.03, 0.025]}
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    beside.report([0.05, 0.04, 0.06], ["cpu", "cpu"])
    out = capsys.readouterr().out
    assert "  pipelined                        50.0 ms    640.0 samples/s\n" in out
    assert "  unpipelined                      20.0 ms   1600.0 samples/s  final loss nan" in out
    assert "  unpipelined,  2 micro-batches    25.0 ms   1280.0 samples/s" in out
    assert ("the pipelined step takes 2.50x the unpipelined one: 1.25x for the micro-batches "
            "and recomputation these settings ask for, 2.00x for the pipeline itself") in out
    assert "with 2 intra-op threads" in out and "has no idle device to fill" in out
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    beside.report([0.05, 0.04, 0.06], ["cpu", "cpu"])
    assert "intra-op" not in capsys.readouterr().out


def test_local_run_of_a_schedule_with_two_stages_per_thread(
        capsys: pytest.CaptureFixture) -> None:
    main(["--steps", "1", "--batch", "8", "--balance-by", "params", "--schedule",
          "interleaved_1f1b"])
    out = capsys.readouterr().out
    assert "partition 3 on cpu:" in out and "partition 4" not in out
    assert "schedule 'interleaved_1f1b', 4 stages x 4 micro-batches" in out
    assert "thread 1: " in out and "thread 2" not in out


def test_trace_option_writes_the_last_steps_json_and_svg(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    where = tmp_path / "out"
    main(["--steps", "2", "--batch", "8", "--balance-by", "params", "--trace", str(where),
          "--schedule", "zb_h1"])
    out = capsys.readouterr().out
    trace = json.loads((where / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"F0", "F3", "I0", "W3", "loss 3"} <= names
    assert ET.parse(where / "trace.svg").getroot().tag.endswith("svg")
    assert "step 0 (zb_h1, 4 micro-batches)" in out and "biggest wait: stage" in out
    assert str(where / "trace.json") in out


def test_distributed_run_lists_its_stages_and_shows_the_clock(
        capfd: pytest.CaptureFixture) -> None:
    main(["--processes", "2", "--steps", "2", "--batch", "8", "--balance-by", "params"])
    out = capfd.readouterr().out
    assert "20 layers over 2 processes (gloo)" in out
    assert "stage 0 on rank 0:" in out and "stage 1 on rank 1:" in out
    assert "schedule '1f1b', 2 stages x 4 micro-batches" in out and "rank 1: " in out
    assert "done: 16 samples" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("trace: 1 step, "), last


def test_gpt2_tiny_is_converted_and_learns(capsys: pytest.CaptureFixture) -> None:
    loss = main(["--model", "gpt2-tiny", "--steps", "12", "--batch", "16",
                 "--balance-by", "params"])
    out = capsys.readouterr().out
    assert "TinyGPT converted by to_sequential into 8 layers" in out
    assert "partition 0 on cpu: tok, pos, blocks.0" in out  # units by their names
    assert "  unpipelined    " in out and "nan" not in out  # the plain TinyGPT's step
    first = float(out.split("step   1/12  loss ")[1].split()[0])
    assert loss < first - 1.0, (first, loss)  # ln(32) = 3.47 at first: it learns


def test_gpt2_tiny_is_for_the_local_pipe(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model", "gpt2-tiny", "--processes", "2"])
    assert "--model gpt2-tiny runs in the local Pipe" in capsys.readouterr().err
