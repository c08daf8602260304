"""The core stays free of the flower and tracking extras: a run imports neither Flower, MLflow nor
TensorBoard, and asking for them without the extra installed is a one-line error naming it (the
extras are hidden from a subprocess, so this runs whether or not they are installed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_run_imports_no_extra() -> None:
    res = _python(
        """
        import sys
        from felix import api
        from felix.cli import build_parser
        build_parser()
        api.run({"partition": {"num_clients": 5}, "run": {"max_aggregations": 1}})
        loaded = sorted(m for m in ("flwr", "mlflow", "tensorboard") if m in sys.modules)
        print("LOADED", loaded)
        """
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "LOADED []" in res.stdout


def test_asking_for_an_absent_extra_names_it(tmp_path: Path) -> None:
    res = _python(
        """
        import sys
        from pathlib import Path
        for m in ("flwr", "mlflow", "tensorboard", "torch.utils.tensorboard"):
            sys.modules[m] = None  # as if not installed
        from felix.config import ConfigError
        from felix.engine.setup import resolve_config
        from felix.sim.run import run_config
        small = {"partition": {"num_clients": 5}, "run": {"max_aggregations": 1}}
        for over in ({"client": {"flower_app": "mypkg.client_app:app"}},
                     {"run": {**small["run"], "log_to": ["mlflow"]}},
                     {"run": {**small["run"], "log_to": ["tensorboard"]}}):
            try:
                cfg = resolve_config(None, None, {**small, **over})
                run_config(cfg, None, plots=False, live_dir=Path(sys.argv[1]))
            except ConfigError as exc:
                print("ERR", exc)
        """,
        str(tmp_path),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    errors = [line for line in res.stdout.splitlines() if line.startswith("ERR")]
    assert len(errors) == 3, res.stdout
    assert 'pip install "felix-fl[flower]"' in errors[0]
    assert 'pip install "felix-fl[tracking]"' in errors[1] and 'felix-fl[tracking]"' in errors[2]
