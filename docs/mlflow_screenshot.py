"""Take the README's screenshot, ``docs/mlflow-run-page.png``: the MLflow page of a run folder's
parent run, served by the command ``moe pipeline`` printed for it (the quickstart's folder,
``runs/pretrain-tiny``, by default).

    python docs/mlflow_screenshot.py [RUN_DIR] [--out PNG]

Needs ``pip install playwright`` and a system Chromium (``chromium-headless-shell``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from flows.tracking import ui_command, ui_page

DOCS = Path(__file__).resolve().parent


def serve(command: str) -> tuple[subprocess.Popen, str]:
    """``command`` (``VAR=value mlflow ui ...``) on a free loopback port; its process and URL
    once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    words = command.split()
    at = words.index("mlflow")
    env = {**os.environ, **dict(w.split("=", 1) for w in words[:at])}
    mlflow = str(Path(sys.executable).parent / "mlflow")
    args = [mlflow, *words[at + 1 :], "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(args, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"{command} did not answer") from None
            time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="?", default="runs/pretrain-tiny")
    p.add_argument("--out", default=str(DOCS / "mlflow-run-page.png"))
    args = p.parse_args()
    from mlflow.tracking import MlflowClient
    from playwright.sync_api import expect, sync_playwright

    run_dir = Path(args.run_dir).resolve()
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    parent = json.loads((run_dir / "mlflow.json").read_text())["parent"]
    run = MlflowClient(uri).get_run(parent)
    names = ("chromium-headless-shell", "chromium", "chromium-browser")
    chromium = next((shutil.which(b) for b in names if shutil.which(b)), None)
    proc, url = serve(ui_command(uri))
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(120_000)
            expect.set_options(timeout=120_000)
            page.goto(f"{url}/{ui_page(run.info.experiment_id, parent)}")
            expect(page.get_by_text(run.info.run_name, exact=True).first).to_be_visible()
            for metric in ("final_loss", "perplexity", "tokens_per_s_per_gpu"):
                expect(page.get_by_text(metric, exact=True).first).to_be_visible()
            expect(page.get_by_text("Child runs", exact=True)).to_be_visible()
            close = page.get_by_role("button", name="Close")  # the assistant's side panel
            if close.count():
                close.first.click()
            # the run folder's tag holds this machine's path: masked in a published picture
            folder = page.get_by_text(str(run_dir))
            page.screenshot(path=args.out, mask=[folder], mask_color="#e0e0e0")
            browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
    print(f"{args.out}: run {run.info.run_name} ({parent})")


if __name__ == "__main__":
    main()
