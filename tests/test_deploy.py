"""The Kubernetes example in deploy/ is checked against the API's schemas, offline.

`kubernetes-validate --strict` bundles the schemas of each Kubernetes release and rejects
unknown properties. Each file in deploy/broken/ carries exactly one deliberate mistake, so the
check is shown to catch that kind of mistake, not merely to run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
VALIDATE = Path(sys.executable).with_name("kubernetes-validate")
K8S_VERSION = "1.37.0"


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(VALIDATE), "--strict", "-k", K8S_VERSION, str(path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["infer-lab.yaml", "router.yaml"])
def test_manifests_validate(name: str) -> None:
    result = validate(DEPLOY / name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout + result.stderr


def test_every_resource_kind_is_checked() -> None:
    out = validate(DEPLOY / "router.yaml")
    text = out.stdout + out.stderr
    for kind in ("serviceaccount", "role", "rolebinding", "deployment", "service"):
        assert f"resource {kind}/" in text, text


@pytest.mark.parametrize(("name", "reason"), [
    ("replicas-not-integer.yaml", "is not of type 'integer'"),
    ("unknown-field.yaml", "'imagePulPolicy' was unexpected"),
    ("probe-without-port.yaml", "'port' is a required property"),
])
def test_broken_manifests_fail(name: str, reason: str) -> None:
    result = validate(DEPLOY / "broken" / name)
    assert result.returncode != 0
    assert reason in result.stdout + result.stderr


def test_probes_use_health_and_the_served_port() -> None:
    text = (DEPLOY / "infer-lab.yaml").read_text()
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        block = text.split(probe + ":", 1)[1].split("Probe:", 1)[0]
        assert "path: /health" in block and "port: http" in block, probe
    assert "containerPort: 8000" in text


def test_the_pod_outlasts_the_servers_drain() -> None:
    """The container's args parse as `infer-lab serve` flags (after the image's entrypoint),
    and the pod's grace covers the drain they set plus uvicorn's 5 s to close connections
    (serve/server.py): else SIGKILL would cut requests the drain promised to finish."""
    import yaml

    from infer_lab.cli import build_parser

    docs = yaml.safe_load_all((DEPLOY / "infer-lab.yaml").read_text())
    (deployment,) = [d for d in docs if d and d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (server,) = [c for c in pod["containers"] if c["name"] == "server"]
    entry = (DEPLOY / "Dockerfile").read_text().split("ENTRYPOINT ", 1)[1].splitlines()[0]
    argv = [*yaml.safe_load(entry), *server["args"]]
    assert argv[:2] == ["infer-lab", "serve"]
    args = build_parser().parse_args(argv[1:])
    assert args.shutdown_grace > 10  # raised from the default for long generations
    assert args.shutdown_grace + 5 <= pod["terminationGracePeriodSeconds"]
