"""Ranks on two hosts: two network namespaces joined by a veth pair stand for two machines, each with
its own address and no other route between them. torchrun (the launcher users run, with its c10d
rendezvous hosted on the first host) starts one rank on each; the suite's driver, on the first host,
runs a capability on the world they form (gloo told its interface with GLOO_SOCKET_IFNAME, as on a
cluster whose hosts have several) and judges it as it judges local ranks. Needs root (``ip netns``),
as on the CI machine; skipped with the reason elsewhere."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 600  # a guard, not a measure: the run below takes 30-60 s on two loaded cores


@dataclass(frozen=True)
class Host:
    namespace: str
    interface: str
    address: str

    def command(self, *words: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *words]


def _ip(*words: str) -> None:
    subprocess.run(["ip", *words], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two hosts are emulated with network namespaces, which need root and iproute2's ip")
    tag = secrets.token_hex(3)
    subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}"
    hosts = [Host(f"pc-host{i}-{tag}", f"pc{i}-{tag}", f"{subnet}.{i + 1}") for i in range(2)]
    made: list[str] = []
    try:
        for host in hosts:
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
        _ip("link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface)
        for host in hosts:
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as error:
        for namespace in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        pytest.skip(f"network namespaces cannot be made here: {' '.join(error.cmd)}: {error.stderr.strip()}")
    yield hosts
    for namespace in made:  # deleting a namespace deletes its end of the pair, and so the pair
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _port() -> int:
    with socket.socket() as probe:  # namespaces have ports of their own: any free number here will do
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1] // 4 * 4


def test_a_capability_runs_on_ranks_that_torchrun_starts_on_two_hosts(two_hosts):
    first, second = two_hosts
    driver_port, rendezvous_port = _port(), _port() + 2
    key = secrets.token_hex(32)
    # the launchers first, as a cluster's scheduler may start them: their ranks dial a driver that is
    # not listening yet and keep dialling (CONFORMANCE_DIAL_TIMEOUT)
    launchers = []
    for node, host in enumerate(two_hosts):
        env = {
            **os.environ,
            "CONFORMANCE_DRIVER": f"{first.address}:{driver_port}",
            "CONFORMANCE_AUTHKEY": key,
            "GLOO_SOCKET_IFNAME": host.interface,
            "PYTHONPATH": str(ROOT),
        }
        launchers.append(
            subprocess.Popen(
                host.command(
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "1",
                    "--node-rank",
                    str(node),
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-id",
                    "two-hosts",
                    "--rdzv-endpoint",
                    f"{first.address}:{rendezvous_port}",
                    "--local-addr",
                    host.address,
                    # the namespaces share one hostname, from which torchrun would guess who hosts
                    # the rendezvous store: the first host says so (hosts of their own need not)
                    "--rdzv-conf",
                    f"is_host={str(node == 0).lower()}",
                    "-m",
                    "parallelism_conformance.harness.rank",
                ),
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    driver = subprocess.Popen(
        first.command(
            sys.executable,
            "-m",
            "pytest",
            "conformance/test_collectives.py",
            "-q",
            "-p",
            "no:randomly",
            "--impl",
            "parallelism_conformance.impls",
            "--capability",
            "broadcast",
            "--hypothesis-profile=brief",
            "--attach",
            "2",
            "--attach-address",
            f"{first.address}:{driver_port}",
            "--attach-timeout",
            "300",
        ),
        cwd=ROOT,
        env={**os.environ, "CONFORMANCE_AUTHKEY": key},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = driver.communicate(timeout=RUN_TIMEOUT_S)
        logs = [launcher.communicate(timeout=60)[0] for launcher in launchers]
    finally:
        for process in (driver, *launchers):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert driver.returncode == 0, output[-6000:] + "\n".join(log[-2000:] for log in logs)
    assert re.search(r"broadcast\s+[1-9]\d*\s+0\s+\d+\s+pass", output), output[-3000:]
    assert "attached" in output, output[-3000:]  # the coverage line names the attached world
    assert all(launcher.returncode == 0 for launcher in launchers), output[-2500:] + "\n".join(log[-4000:] for log in logs)
