"""Fake /proc trees and kubelet pod lists: stand-ins for Kubernetes and container runtimes, which this machine
lacks. The cgroup paths are the layouts the runtimes really write (cgroup v2)."""
from __future__ import annotations

import json

CID = "9d3c5e1f" * 8
POD = "1f2e3d4c-5b6a-4789-9abc-def012345678"
CONTAINERD_POD_CGROUP = (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD.replace('-', '_')}"
                         f".slice/cri-containerd-{CID}.scope\n")


def fake_proc(root, pid: int, *, environ: bytes = b"", cgroup: str = "0::/\n", comm: str = "python3") -> None:
    """A /proc/<pid> with the files the resolver reads (no exe: comm keys the cache)."""
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    fields = ["S"] + ["0"] * 18 + ["1000"] + ["0"] * 30  # fields 3..52 of proc(5); 22 is starttime
    (d / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")
    (d / "environ").write_bytes(environ)
    (d / "cgroup").write_text(cgroup)


def kubelet_pods_file(path, name: str = "trainer-0", namespace: str = "team-vision", container: str = "trainer"):
    """The kubelet's read-only pod list (GET /pods), one pod holding container CID."""
    path.write_text(json.dumps({"kind": "PodList", "apiVersion": "v1", "items": [{
        "metadata": {"name": name, "namespace": namespace, "uid": POD},
        "status": {"containerStatuses": [{"name": container, "containerID": f"containerd://{CID}"}]}}]}))
    return path
