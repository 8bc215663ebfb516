"""A Ray cluster on this machine started the way an operator starts one: ``ray start --head``, then
``ray start --address`` per node — each node one ``ray start --block`` process, with its own temp
dir, free ports, and an environment of its own that holds nothing of the driver's (no
``PYTHONPATH``, no vLLM or Hugging Face variables): whatever the run's actors need must travel with
the job (``rlhf_switch.runtime_env``). A node is lost as a machine goes — that process and all its
descendants killed (SIGKILL) by their pids — and added as one joins.

    with operator_cluster(2) as nodes:    # the head and one more node, 2 CPUs and 2 GPUs each
        cfg["ray_address"] = nodes.address  # the run joins it
        nodes.kill(nodes.workers[0])        # a node lost
        nodes.add()                         # a node joins

Token authentication is off (``RAY_AUTH_MODE=disabled``) on every node; the driver needs the same
(``DRIVER_ENV``). Light at the top level: no Ray import (the driver's Ray is the test's business).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))  # the venv's `ray` command
DRIVER_ENV = {"RAY_AUTH_MODE": "disabled"}
STARTED = "Ray runtime started."


def free_ports(n: int) -> list[int]:
    """``n`` ports the OS has free now (bound to port 0, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def node_env() -> dict[str, str]:
    """What an operator's shell gives ``ray start`` here: a path to the venv, a home, no auth — and
    nothing else of this process's environment."""
    return {"PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
            "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8", **DRIVER_ENV}


@dataclass
class Node:
    proc: subprocess.Popen   # `ray start --block`, the leader of the node's process group
    temp_dir: Path
    log: Path
    head: bool

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def owns(self, node_info: dict) -> bool:
        """Whether an entry of ``ray.nodes()`` is this node (its object store lives in its temp dir)."""
        return node_info.get("ObjectStoreSocketName", "").startswith(str(self.temp_dir) + os.sep)


class RayNodes:
    def __init__(self, root: Path, cpus: int = 2, gpus: int = 2, timeout_s: float = 120.0):
        self.root, self.cpus, self.gpus, self.timeout_s = Path(root), cpus, gpus, timeout_s
        self.nodes: list[Node] = []
        self.address: str | None = None

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def workers(self) -> list[Node]:
        """The nodes other than the head that still run."""
        return [n for n in self.nodes[1:] if n.alive()]

    def start(self, n: int) -> "RayNodes":
        """The head, then ``n - 1`` more nodes."""
        self._start_node(head=True)
        for _ in range(n - 1):
            self.add()
        return self

    def add(self) -> Node:
        """One more node joins the cluster (returns once its raylet runs)."""
        return self._start_node(head=False)

    def _start_node(self, head: bool) -> Node:
        # a short temp dir: Ray's unix sockets live under it (a path limit of ~107 bytes)
        temp = self.root / f"n{len(self.nodes)}"
        temp.mkdir(parents=True, exist_ok=True)
        agent, = free_ports(1)
        args = [RAY, "start", "--block", "--disable-usage-stats", f"--num-cpus={self.cpus}",
                f"--num-gpus={self.gpus}", f"--temp-dir={temp}", f"--dashboard-agent-listen-port={agent}",
                "--min-worker-port=0", "--max-worker-port=0"]
        if head:
            gcs, dashboard, client = free_ports(3)
            args += ["--head", f"--port={gcs}", "--include-dashboard=false", f"--dashboard-port={dashboard}",
                     f"--ray-client-server-port={client}"]
        else:
            args += [f"--address={self.address}"]
        log = temp / "ray_start.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(args, env=node_env(), cwd=temp, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # as from a shell of its own
        node = Node(proc, temp, log, head)
        self.nodes.append(node)
        deadline = time.monotonic() + self.timeout_s
        while STARTED not in log.read_text():
            if not node.alive() or time.monotonic() > deadline:
                self.stop(node)
                raise RuntimeError(f"ray start ({'head' if head else 'node'}) did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        if head:
            self.address = re.search(r"ray start --address='([^']+)'", log.read_text()).group(1)
        return node

    def kill(self, node: Node) -> None:
        """The node goes as a machine does: every process of it killed at once (SIGKILL) — the
        ``ray start`` process and all its descendants (Ray puts each worker in a process group of
        its own, so not one group)."""
        frozen: set[int] = set()
        while True:  # stopped first, so that none starts another process meanwhile
            new = [pid for pid in [node.pid] + descendants(node.pid) if pid not in frozen]
            if not new:
                break
            for pid in new:
                signal_pid(pid, signal.SIGSTOP)
                frozen.add(pid)
        for pid in frozen:
            signal_pid(pid, signal.SIGKILL)
        node.proc.wait(timeout=30)

    def stop(self, node: Node) -> None:
        """The node stopped (at the end of the tests: as ``kill``, nothing to keep)."""
        if node.alive():
            self.kill(node)

    def node_id(self, ray, node: Node) -> str:
        """``node``'s id as the connected driver's Ray sees it."""
        return next(n["NodeID"] for n in ray.nodes() if node.owns(n))

    def wait_seen(self, ray, node: Node, alive: bool = True) -> str:
        """Until the connected driver's Ray reports ``node`` alive (or dead); its id."""
        deadline = time.monotonic() + self.timeout_s
        while not any(node.owns(n) and n["Alive"] == alive for n in ray.nodes()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray did not report node {node.temp_dir.name} {'alive' if alive else 'dead'}")
            time.sleep(0.5)
        return self.node_id(ray, node)

    def shutdown(self) -> None:
        """Every node stopped, the workers first."""
        for node in reversed(self.nodes):
            self.stop(node)


@contextmanager
def operator_cluster(n: int, cpus: int = 2, gpus: int = 2):
    """``n`` nodes (``RayNodes.start``) in a temp dir of their own, ``DRIVER_ENV`` in this
    process's environment while they run; every node stopped and the dir removed after."""
    root = Path(tempfile.mkdtemp(prefix="rn-"))  # short: Ray's socket paths live under it
    saved = {k: os.environ.get(k) for k in DRIVER_ENV}
    os.environ.update(DRIVER_ENV)
    nodes = RayNodes(root, cpus, gpus)
    try:
        yield nodes.start(n)
    finally:
        nodes.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def joined(address: str, runtime_env: dict | None = None):
    """This process as a Ray driver of the cluster at ``address`` while the scope lasts."""
    import ray

    ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
