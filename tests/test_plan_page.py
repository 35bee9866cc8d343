"""``moe plan --html``: the page's numbers against the planner's on a grid of models x GPU types
x layouts (the page's own script and data, run by QuickJS), the calibration, and the
refusals of a bad output path."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest
from rich.console import Console

import moe_core.cli as cli
from moe_core.compose import compose_run
from moe_core.config import ConfigError, ParallelConfig
from moe_core.hardware import GPUS, MEASURED
from moe_core.plan import fit_refusal, max_in_flight, plan, step_time
from moe_core.planpage import TOUR, evaluate, render, write_run_page

ROOT = Path(__file__).resolve().parent.parent
CUSTOM = ["model=small-64e", "model.n_layers=8", "model.d_model=768", "model.n_heads=12"]
CUSTOM += ["cluster=local-gpu", "cluster.procs_per_node=1", "cluster.gpus_per_node=1"]
CUSTOM += ["train.dtype=bf16"]  # bf16 autocast over fp32 weights: no preset, the page adds it
AUTOCAST = "fp32 weights, bf16 compute, fp32 state"


def one_sentence(message: str) -> bool:
    return message.endswith(".") and not re.search(r"[.!?]\s+[A-Z]", message)


def page_scripts(page: str) -> tuple[dict, str]:
    """The data and the planner script the page runs, cut out of the written HTML."""
    data = re.search(r'<script id="plan-data" type="application/json">(.*?)</script>', page, re.S)
    scripts = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert data is not None and len(scripts) == 2
    return json.loads(data.group(1)), scripts[0]


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    """The page ``moe plan --html`` writes for a custom-sized model (it joins conf/model's)."""
    out = tmp_path_factory.mktemp("page") / "plan.html"
    assert cli.main(["plan", *CUSTOM, "--html", str(out)]) == 0
    return out.read_text()


def page_engine(page: str):
    """A JavaScript engine (QuickJS, the ``test`` extra) holding the page's data and planner."""
    quickjs = pytest.importorskip("quickjs", reason="quickjs is not installed (the test extra)")
    data, planner = page_scripts(page)
    js = quickjs.Context()
    js.eval(planner)
    js.eval(f"var DATA = {json.dumps(data)};")
    return js


def run_planner(page: str, layouts: list[dict]) -> list[dict]:
    """``planLayout`` of the page on each layout, as the browser runs it."""
    js = page_engine(page)
    script = f"JSON.stringify({json.dumps(layouts)}.map((L) => planLayout(DATA, L)))"
    return json.loads(js.eval(script))


def layout(**kw) -> dict:
    base = dict(
        gpu="H200",
        nodes=1,
        gpus_per_node=1,
        pp=1,
        dp=1,
        ep=1,
        virtual_stages=1,
        recompute="none",
        dispatcher="all_to_all",
        precision="fp32",
        micro_batch_size=1,
        global_batch_size=2,
        seq_len=128,
    )
    return {**base, **kw}


# Valid for some models and refused for others (layers, experts, sequence length), plus
# refusals of their own: a cluster of the wrong size, batches that do not divide.
LAYOUTS = [
    layout(),
    layout(gpus_per_node=8, dp=4, ep=2, precision="bf16", recompute="selective",
           micro_batch_size=2, global_batch_size=32, seq_len=256),
    layout(gpus_per_node=8, ep=8, dispatcher="nvshmem_rowwise", precision="pure-bf16",
           global_batch_size=16, seq_len=256),
    layout(nodes=2, gpus_per_node=8, pp=2, dp=2, ep=4, recompute="block", precision="bf16",
           global_batch_size=64),
    layout(gpus_per_node=8, pp=4, virtual_stages=2, ep=2, precision="bf16", global_batch_size=16),
    layout(nodes=64, gpus_per_node=8, pp=8, dp=4, ep=16, recompute="block", precision="bf16",
           global_batch_size=128, seq_len=512),
    layout(nodes=2, gpus_per_node=1, ep=2, dispatcher="nvshmem_rowwise", recompute="selective",
           precision="bf16", micro_batch_size=2, global_batch_size=8, seq_len=1024),
    layout(nodes=2, gpus_per_node=8, dp=8),  # the cluster starts 16, the layout needs 8
    layout(nodes=2, gpus_per_node=1, pp=2, virtual_stages=2, global_batch_size=3),
    layout(micro_batch_size=3, global_batch_size=8),
    layout(virtual_stages=2),  # interleaving needs two stages
    layout(gpus_per_node=4, dp=2, ep=2, precision=AUTOCAST, global_batch_size=8, seq_len=256),
]  # fmt: skip


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1.0)


@pytest.mark.slow
def test_page_numbers_are_the_planners_on_a_grid(page: str):
    """Models (conf/model and the custom size) x GPU types x layouts: the same refusal sentence,
    or the same memory by part, communication, step time, tokens/s and MFU."""
    data, _ = page_scripts(page)
    assert "small-64e (custom)" in data["models"]
    grid = [
        {**lay, "model": model, "gpu": gpu}
        for model, gpu, lay in itertools.product(data["models"], GPUS, LAYOUTS)
    ]
    page_results = run_planner(page, grid)
    numbers = refusals = 0
    for lay, mine in zip(grid, page_results, strict=True):
        ref = evaluate(lay, data)
        assert mine["refusal"] == ref["refusal"], lay
        if "memory" not in ref:
            assert "memory" not in mine, lay
            refusals += 1
            continue
        numbers += 1
        assert mine["memory"].keys() == ref["memory"].keys()
        for part, value in ref["memory"].items():
            assert close(mine["memory"][part], value), (lay, part)
        assert close(mine["total"], ref["total"]) and mine["busiest_stage"] == ref["busiest_stage"]
        assert all(close(a, b) for a, b in zip(mine["stages"], ref["stages"], strict=True))
        for kind, value in ref["comm"].items():
            assert close(mine["comm"][kind], value), (lay, kind)
        for name, value in ref["time"].items():
            assert math.isclose(mine["time"][name], value, rel_tol=1e-9, abs_tol=1e-15), name
        assert mine["micro_batches"] == ref["micro_batches"]
    # the grid holds both: layouts the planner sizes, and layouts the config refuses
    assert numbers >= 60 and refusals >= 60, (numbers, refusals)


def test_page_in_flight_is_the_schedules(page: str):
    """The pipeline's in-flight micro-batches: the page's closed form against the schedule the
    runner executes, for 1F1B and interleaved 1F1B."""
    js = page_engine(page)
    cases = [
        (pp, v, s, n)
        for pp in (1, 2, 3, 4, 8)
        for v in ((1, 2, 3) if pp > 1 else (1,))
        for s in range(pp)
        for n in (1, 2, 3, 4, 8, 16)
        if v == 1 or n % pp == 0
    ]
    got = json.loads(js.eval(f"JSON.stringify({json.dumps(cases)}.map((c) => inFlight(...c)))"))
    expected = [
        max_in_flight(
            ParallelConfig(
                pp=pp, virtual_stages=v, pp_schedule="interleaved_1f1b" if v > 1 else "1f1b"
            ),
            s,
            n,
        )
        for pp, v, s, n in cases
    ]
    assert got == expected


def test_page_is_self_contained_and_starts_at_the_run(page: str):
    data, _ = page_scripts(page)
    assert not re.search(r"""(src|href)\s*=|https?://|@import|url\(""", page)
    run = compose_run(CUSTOM)
    start = data["initial"]
    assert start["model"] == "small-64e (custom)" and start["precision"] == AUTOCAST
    assert data["models"][start["model"]]["config"]["d_model"] == 768
    assert evaluate(start, data)["total"] == plan(run).memory.total
    # the tour: one GPU -> data -> expert -> pipeline -> 1t on 512 GPUs
    world = [t["layout"]["pp"] * t["layout"]["dp"] * t["layout"]["ep"] for t in data["tour"]]
    assert world == [1, 8, 8, 64, 512]
    assert [t["layout"]["model"] for t in data["tour"]][-1] == "1t"
    assert all(evaluate(t["layout"], data)["refusal"] is None for t in data["tour"])


def test_calibration_is_the_measured_h200_run():
    """The compute rate is the JSON's figure, and a one-GPU layout predicts exactly it."""
    result = json.loads((ROOT / MEASURED.source).read_text())
    assert result["gpu"] == f"NVIDIA {MEASURED.gpu}"
    assert MEASURED.model_tflops == pytest.approx(result["trainer_tflops"], abs=0.005)
    assert MEASURED.peak_gib == pytest.approx(result["trainer"]["peak_mem_gib"], abs=0.005)
    assert (result["layers"], result["seq"], result["mbs"]) == (16, 4096, 4)
    assert result["precision"] == "pure-bf16"  # the tour's first step, below
    run = compose_run(TOUR[0][3])  # the tour's first step: the measured layout
    t = step_time(plan(run))
    assert t.bubble == 0 and t.all_to_all == t.reduce_scatter == t.pipeline == 0
    assert t.tokens_per_s_per_gpu * plan(run).flops_per_token / 1e12 == pytest.approx(
        MEASURED.model_tflops
    )


def test_gpu_memory_decides_the_refusal():
    """pp8-dp8-ep8 for 1t: refused on a 141 GiB H200 in one sentence, fits a 288 GiB B300."""
    run = compose_run(["parallel=pp8-dp8-ep8"], config_name="pretrain-1t")
    p = plan(run)
    message = fit_refusal(p)
    assert message is not None and one_sentence(message)
    assert f"needs {p.per_gpu_gib:.1f} GiB per GPU but a H200 has 141 GiB" in message
    run.cluster.gpu_type, run.cluster.gpu_memory_gib = "B300", GPUS["B300"].memory_gib
    assert fit_refusal(plan(run)) is None


def test_step_time_needs_a_known_gpu():
    p = plan(compose_run([]))  # local CPU processes: no GPU type
    with pytest.raises(ConfigError) as err:
        step_time(p)
    message = str(err.value)
    assert message.startswith("cluster.gpu_type='none' is not allowed") and one_sentence(message)
    assert "H100, H200, B200, B300" in message
    assert step_time(p, GPUS["H100"]).step > step_time(p, GPUS["B200"]).step  # faster peak


def test_all_to_all_time_follows_the_links():
    """ep 16 across two nodes sends half its all-to-all over the NIC: slower than ep 8."""
    inside = compose_run(["parallel=pp8-dp8-ep8"], config_name="pretrain-1t")
    across = compose_run([], config_name="pretrain-1t")
    a, b = plan(inside), plan(across)
    t_in, t_across = step_time(a), step_time(b)
    gpu = GPUS["H200"]
    assert t_in.all_to_all == pytest.approx(a.comm.all_to_all / (gpu.nvlink_gb_s * 1e9))
    share = 8 / 15  # ranks of the 16 on the other node
    assert t_across.all_to_all == pytest.approx(
        b.comm.all_to_all * share / (gpu.network_gb_s * 1e9)
    )


@pytest.mark.slow
def test_html_refuses_an_existing_file_and_overwrites_on_request(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "console", Console(width=300))
    out = tmp_path / "mine.html"
    out.write_text("my notes")
    assert cli.main(["plan", "--html", str(out)]) == 2
    message = capsys.readouterr().out.strip()  # the sentence alone: refused before the table
    assert message.startswith("error: --html") and "exists already" in message
    assert "--overwrite" in message and one_sentence(message)
    assert out.read_text() == "my notes"
    assert cli.main(["plan", "--html", str(out), "--overwrite"]) == 0
    assert "plan-data" in out.read_text()


@pytest.mark.parametrize(
    "name, expected",
    [("no-such-dir/p.html", "does not exist"), ("p.txt", "ending in .html"), ("d.html", "is a")],
)
def test_html_refuses_a_bad_path_in_one_sentence(name, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "console", Console(width=300))
    (tmp_path / "d.html").mkdir()
    assert cli.main(["plan", "--html", str(tmp_path / name)]) == 2
    message = capsys.readouterr().out.strip()
    assert message.startswith("error: --html") and expected in message and one_sentence(message)
    assert name in message


def test_html_refuses_an_unwritable_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "console", Console(width=300))

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "write_text", refuse)
    assert cli.main(["plan", "--html", str(tmp_path / "p.html")]) == 2
    message = capsys.readouterr().out.strip().splitlines()[-1]
    assert "cannot be written (Permission denied)" in message and one_sentence(message)


def test_html_refuses_an_unknown_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "console", Console(width=300))
    assert cli.main(["plan", "model=2t", "--html", str(tmp_path / "p.html")]) == 2
    message = capsys.readouterr().out.strip()
    assert message.startswith("error: model='2t' is not allowed: one of 1t, 47b")
    assert not (tmp_path / "p.html").exists()


def test_page_data_cannot_close_its_script(page: str):
    """Text in the data (a model name, the tour) never ends the script element holding it."""
    data, _ = page_scripts(page)
    data["tour"][0]["text"] = "</script><script>alert(1)</script><!--"
    written = render(data)
    again, _ = page_scripts(written)
    assert again == data and written.count("</script>") == 3


def test_run_page_is_replaced_and_never_stops_a_run(tmp_path, monkeypatch, caplog):
    """The pipeline's plan.html: written (and rewritten) in the run directory; without a conf/
    folder to read models from, a warning and no page instead of an error."""
    import moe_core.compose

    run = compose_run([])
    (tmp_path / "plan.html").write_text("an older run's page")
    assert write_run_page(run, tmp_path) == tmp_path / "plan.html"
    assert "plan-data" in (tmp_path / "plan.html").read_text()
    monkeypatch.setattr(moe_core.compose, "DEFAULT_CONFIG_DIR", tmp_path / "no-conf")
    (tmp_path / "other").mkdir()
    assert write_run_page(run, tmp_path / "other") is None
    assert not (tmp_path / "other" / "plan.html").exists()
    assert "no plan.html for this run: config directory" in caplog.text
