"""The build-a-run page in a real browser: headless Chromium (the system's package) driven by
Playwright, the page loaded from a file URL with every network request refused. Changing the
layout controls (and typed custom model sizes) shows the planner's memory and refusal
sentences; screenshots go to docs/.

Skipped where Playwright or a Chromium binary is not installed (CI installs neither)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import chromium

from moe_core import cli
from moe_core.compose import compose_run
from moe_core.hardware import MEASURED
from moe_core.plan import GIB, fit_refusal, plan
from moe_core.planpage import CUSTOM_MODEL, TOUR

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

ROOT = Path(__file__).resolve().parent.parent
BROWSER = chromium()
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium binary installed")


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:,.2f} GiB"


def set_value(page, control: str, value: str) -> None:
    """Set a control as a user does: the page recomputes on its input event."""
    page.locator(f"#{control}").evaluate(
        "(el, v) => { el.value = v; el.dispatchEvent(new Event('input')); }", value
    )


@pytest.mark.slow
def test_page_in_chromium_offline(tmp_path: Path):
    out = tmp_path / "plan-1t.html"
    assert cli.main(["plan", "--config-name", "pretrain-1t", "--html", str(out)]) == 0
    start = plan(compose_run([], config_name="pretrain-1t"))
    dense8 = plan(compose_run(["parallel=pp8-dp8-ep8"], config_name="pretrain-1t"))
    refused = fit_refusal(dense8)
    assert refused is not None

    blocked: list[str] = []
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=BROWSER)
        page = browser.new_page(viewport={"width": 1200, "height": 1100})
        page.on("pageerror", lambda e: errors.append(str(e)))

        def refuse(route):
            if not route.request.url.startswith("file:"):
                blocked.append(route.request.url)
                return route.abort()
            return route.continue_()

        page.route("**/*", refuse)
        page.goto(out.as_uri())

        # The 1t layout on 512 H200s: the planner's total, no refusal.
        assert page.locator("#mem-total").inner_text() == gib(start.memory.total)
        assert page.locator("#refusal").is_hidden()
        assert page.locator("#mem-verdict").inner_text().startswith("fits")
        page.screenshot(path=str(ROOT / "docs" / "plan-page-1t.png"), full_page=True)

        # ep 8 x dp 8: too large for 141 GiB, the sentence fit_refusal writes.
        set_value(page, "ep", "8")
        set_value(page, "dp", "8")
        assert page.locator("#mem-total").inner_text() == gib(dense8.memory.total)
        assert page.locator("#refusal").inner_text() == f"Refused: {refused}"
        assert page.locator("#mem-verdict").inner_text().startswith("does not fit")
        page.screenshot(path=str(ROOT / "docs" / "plan-page-refused.png"), full_page=True)

        # The same layout on a 288 GiB B300 fits.
        set_value(page, "gpu", "B300")
        assert page.locator("#refusal").is_hidden()
        assert page.locator("#mem-total").inner_text() == gib(dense8.memory.total)

        # An expert split that does not divide 128 experts: the config's sentence, no numbers.
        set_value(page, "ep", "3")
        assert page.locator("#refusal").inner_text() == (
            "Refused: parallel.ep=3 is not allowed: a divisor of model.n_experts (128)."
        )
        assert page.locator("#mem-total").count() == 0

        # The tour's first step: OLMoE-1B-7B on one H200.
        page.get_by_role("button", name="1. One GPU").click()
        one = plan(compose_run(TOUR[0][3]))
        assert page.locator("#mem-total").inner_text() == gib(one.memory.total)
        assert "OLMoE-1B-7B" in page.locator("#tour-text").inner_text()
        calibration = page.locator("#calibration").inner_text()
        assert f"{MEASURED.model_tflops:.1f} model TFLOP/s per GPU on one H200" in calibration
        assert f"the planner gives {gib(one.memory.total)} for the same layout" in calibration
        assert MEASURED.source in calibration and "Assumed" in calibration
        page.screenshot(path=str(ROOT / "docs" / "plan-page-tour-1.png"), full_page=True)

        # Custom sizes: they start as the model picked before and plan as moe plan's overrides.
        assert page.locator("#custom").is_hidden()
        set_value(page, "model", CUSTOM_MODEL)
        assert page.locator("#custom").is_visible()
        assert page.locator("#m-d_model").input_value() == "2048"
        assert page.locator("#mem-total").inner_text() == gib(one.memory.total)
        set_value(page, "m-n_layers", "8")
        set_value(page, "m-n_kv_heads", "4")
        fewer = plan(compose_run([*TOUR[0][3], "model.n_layers=8", "model.n_kv_heads=4"]))
        assert page.locator("#mem-total").inner_text() == gib(fewer.memory.total)
        assert page.locator("#refusal").is_hidden()
        set_value(page, "m-n_kv_heads", "5")
        assert page.locator("#refusal").inner_text() == (
            "Refused: model.n_kv_heads=5 is not allowed: it must divide model.n_heads (16)."
        )
        assert page.locator("#mem-total").count() == 0
        set_value(page, "m-n_kv_heads", "")  # as many as n_heads
        set_value(page, "m-top_k", "")
        assert page.locator("#refusal").inner_text() == (
            "Refused: model.top_k='' is not allowed: an integer."
        )
        set_value(page, "model", "olmoe-1b-7b")
        assert page.locator("#custom").is_hidden()
        assert page.locator("#mem-total").inner_text() == gib(one.memory.total)

        # Context parallelism: each sequence over two GPUs, its K/V exchange a row of its own;
        # with pipeline stages the config's sentence.
        set_value(page, "gpus_per_node", "2")
        set_value(page, "cp", "2")
        gpus = ["cluster.procs_per_node=2", "cluster.gpus_per_node=2"]
        cp2 = plan(compose_run([*TOUR[0][3], *gpus, "parallel.cp=2"]))
        assert page.locator("#mem-total").inner_text() == gib(cp2.memory.total)
        assert "pp 1 x dp 1 x cp 2 x ep 1 = 2 GPUs" in page.locator("#world").inner_text()
        row = page.locator("#comm-table tr", has_text="CP key/value").inner_text()
        per_layer, step = re.search(r"\(([\d.]+) GiB per layer.*?\)\t([\d.]+)\t", row).groups()
        assert abs(float(per_layer) - cp2.comm.context_per_layer / GIB) <= 0.0051  # 2 decimals
        assert abs(float(step) - cp2.comm.context / GIB) <= 0.0051 and "NVLink" in row
        set_value(page, "pp", "2")
        assert page.locator("#refusal").inner_text() == (
            "Refused: parallel.cp=2 with parallel.pp=2 is not built yet: context parallelism "
            "runs on layouts without pipeline stages; set parallel.pp=1 or parallel.cp=1."
        )
        browser.close()
    assert blocked == [] and errors == []
