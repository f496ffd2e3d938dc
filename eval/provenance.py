"""What every file in results/ records about its run: the machine, the exact command, the date.
One home, so every benchmark writes the same fields (README quotes numbers from these files).

    from provenance import machine, command      # eval/ is sys.path[0] when a script runs
    res = {"command": command("bench_linear", argv), "machine": machine(), ...}
"""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine() -> dict:
    """Hardware and software of this run; call it after `torch.set_num_threads`. The 1-min
    load average says how busy the (shared) machine was when the run started."""
    import torch
    import transformers
    return {"cpu": cpu_model(), "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_1m_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def command(script: str, argv: list[str] | None = None) -> str:
    """The command line that reproduces this run from the repo root:
    `python eval/<script>.py <args>` (argv None: this process's own arguments)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return f"python eval/{script}.py" + (" " + shlex.join(args) if args else "")


def write_results(stem, res: dict, markdown, plot=None) -> str:
    """`<stem>.json` (res), `<stem>.png` (plot(res, path), if given) and `<stem>.md`
    (markdown(res) plus the plot's name); prints and returns the Markdown."""
    import json
    from pathlib import Path
    out = Path(stem)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    if plot is not None:
        plot(res, out.with_suffix(".png"))
        md += f"\nPlot: {out.with_suffix('.png').name}\n"
    out.with_suffix(".md").write_text(md)
    print(md)
    return md
