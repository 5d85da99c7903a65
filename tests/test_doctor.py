"""`trainwatch doctor`: every preflight check against a fake machine (a fake
/sys tree, mount table, environment, statvfs, limits, resolver, port probe and
GPU list), firing and quiet; the command's output and exit codes; hostile mount
tables and manifests; and the checks' warnings at the top of `trainwatch launch`."""

from __future__ import annotations

import json
import os
import resource
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from util import SCRIPTS, job_json, trainwatch

from trainwatch.diagnostics.runbooks import get_runbook
from trainwatch.inject.fake_nvml import FakeNvml
from trainwatch.views import doctor, fschecks, hostchecks
from trainwatch.views.hostchecks import GpuInfo, Host, Options
from trainwatch.launcher.preflight import read_gpus

GIB = 1 << 30


def statvfs_of(sizes: dict[str, tuple[int, int]], default: tuple[int, int] = (100 * GIB, 200 * GIB)):
    """A statvfs answering (free, total) bytes per path (default for any other path)."""
    def statvfs(path: str):
        free, total = sizes.get(path, default)
        return SimpleNamespace(f_bavail=free, f_blocks=total, f_frsize=1)
    return statvfs


def make_host(tmp_path: Path, *, env: dict | None = None, ifaces: dict | None = None, mounts: str | None = None,
              **kw) -> Host:
    root = tmp_path / "root"
    for name, operstate in (ifaces if ifaces is not None else {"lo": "unknown", "eth0": "up"}).items():
        (root / "sys" / "class" / "net" / name).mkdir(parents=True, exist_ok=True)
        (root / "sys" / "class" / "net" / name / "operstate").write_text(operstate + "\n")
    (root / "sys" / "class" / "net").mkdir(parents=True, exist_ok=True)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    kw.setdefault("statvfs", statvfs_of({}))
    kw.setdefault("getrlimit", lambda res: (0, -1) if res == resource.RLIMIT_CORE else (65536, 65536))
    kw.setdefault("now", time.time)
    return Host(env=env or {}, root=root, home=home,
                mounts=mounts if mounts is not None else "/dev/vda / ext4 rw 0 0\n", **kw)


def by_id(host: Host, opts: Options | None = None) -> dict[str, hostchecks.Check]:
    return {c.id: c for c in doctor.run_checks(host, opts or Options())}


def one(check, host: Host, opts: Options | None = None) -> hostchecks.Check:
    result = check(host, opts or Options())
    assert result.verdict in hostchecks.VERDICTS
    json.dumps(result.to_json())  # evidence is JSON
    get_runbook(result.runbook)  # names a runbook that exists
    return result


# ---- network ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec, expected", [
    ("eth", ["eth0", "eth1"]), ("eth,ib", ["eth0", "eth1", "ib0"]), ("^eth", ["ib0", "lo"]),
    ("=eth", []), ("=eth0", ["eth0"]), ("^=eth0", ["eth1", "ib0", "lo"]), ("^eth,ib,lo", []), ("nosuch", []),
    (" eth1 , ", ["eth1"]),
])
def test_socket_ifname_syntax_prefix_exclusion_and_exact(spec, expected):
    assert hostchecks.match_ifname(spec, ["eth0", "eth1", "ib0", "lo"]) == expected


def test_nccl_socket_ifname_naming_no_interface_fails(tmp_path):
    c = one(hostchecks.check_nccl_socket_ifname, make_host(tmp_path, env={"NCCL_SOCKET_IFNAME": "nosuchif0"}))
    assert c.verdict == "fail" and "nosuchif0" in c.message and "eth0" in c.message
    assert c.evidence["interfaces"] == {"eth0": "up", "lo": "unknown"} and c.evidence["matched"] == []
    c = one(hostchecks.check_nccl_socket_ifname, make_host(tmp_path, env={"NCCL_SOCKET_IFNAME": "^eth,lo"}))
    assert c.verdict == "fail"


@pytest.mark.parametrize("value", [None, "eth", "=eth0", "^lo", "^=docker0"])
def test_nccl_socket_ifname_matching_an_interface_is_quiet(tmp_path, value):
    env = {} if value is None else {"NCCL_SOCKET_IFNAME": value}
    assert one(hostchecks.check_nccl_socket_ifname, make_host(tmp_path, env=env)).verdict == "ok"


def test_nccl_socket_ifname_matching_only_down_interfaces_warns(tmp_path):
    host = make_host(tmp_path, env={"NCCL_SOCKET_IFNAME": "ib"}, ifaces={"lo": "unknown", "ib0": "down"})
    c = one(hostchecks.check_nccl_socket_ifname, host)
    assert c.verdict == "warn" and "down" in c.message


def test_gloo_socket_ifname_takes_exact_names_only(tmp_path):
    assert one(hostchecks.check_gloo_socket_ifname, make_host(tmp_path, env={"GLOO_SOCKET_IFNAME": "eth"})
               ).verdict == "fail"
    assert one(hostchecks.check_gloo_socket_ifname, make_host(tmp_path, env={"GLOO_SOCKET_IFNAME": "eth0"})
               ).verdict == "ok"


def test_master_addr_that_does_not_resolve_fails(tmp_path):
    def resolve(name):
        raise OSError("[Errno -2] Name or service not known")

    c = one(hostchecks.check_master_addr, make_host(tmp_path, env={"MASTER_ADDR": "nowhere"}, resolve=resolve))
    assert c.verdict == "fail" and "nowhere" in c.message and "Name or service" in c.evidence["error"]
    ok = one(hostchecks.check_master_addr, make_host(tmp_path, env={"MASTER_ADDR": "head"},
                                                     resolve=lambda n: ["10.0.0.1"]))
    assert ok.verdict == "ok" and ok.evidence["addresses"] == ["10.0.0.1"]
    assert one(hostchecks.check_master_addr, make_host(tmp_path)).verdict == "ok"


def test_master_addr_on_a_slow_resolver_is_a_skip(tmp_path):
    def resolve(name):
        raise TimeoutError("no answer within 100 ms")

    c = one(hostchecks.check_master_addr, make_host(tmp_path, env={"MASTER_ADDR": "slow"}, resolve=resolve))
    assert c.verdict == "skip" and "resolve" in c.message


@pytest.mark.parametrize("probe, port, verdict", [
    ("taken", "29500", "fail"), ("free", "29500", "ok"), ("remote", "29500", "ok"), ("error: EACCES", "80", "skip"),
    ("free", "http", "fail"), ("free", "70000", "fail"),
])
def test_master_port(tmp_path, probe, port, verdict):
    host = make_host(tmp_path, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                     resolve=lambda n: [n], port_probe=lambda addrs, p: probe)
    assert one(hostchecks.check_master_port, host).verdict == verdict
    assert one(hostchecks.check_master_port, make_host(tmp_path)).verdict == "ok"


def test_probe_port_sees_a_real_listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert hostchecks.probe_port(["127.0.0.1"], port) == "taken"
    assert hostchecks.probe_port(["192.0.2.1"], port) == "remote"  # TEST-NET-1: never this machine


def test_resolve_with_timeout_resolves_localhost_and_reports_failure():
    assert "127.0.0.1" in hostchecks.resolve_with_timeout("localhost", 2.0)
    with pytest.raises(OSError):
        hostchecks.resolve_with_timeout("bad\0name", 2.0)


# ---- NCCL knobs and GPUs ----------------------------------------------------------------------

H100 = GpuInfo(index=0, uuid="GPU-aaaa", name="H100", compute_capability=(9, 0), nvswitch=True)


def test_nccl_proto_algo_overrides_warn(tmp_path):
    c = one(hostchecks.check_nccl_proto_algo, make_host(tmp_path, env={"NCCL_PROTO": "LL128", "NCCL_ALGO": "Tree"}))
    assert c.verdict == "warn" and "NCCL_PROTO=LL128" in c.message and c.evidence == {"NCCL_PROTO": "LL128",
                                                                                       "NCCL_ALGO": "Tree"}
    assert one(hostchecks.check_nccl_proto_algo, make_host(tmp_path)).verdict == "ok"


@pytest.mark.parametrize("gpus, verdict", [
    (None, "skip"), ((), "skip"),
    ((GpuInfo(index=0, compute_capability=(9, 0), nvswitch=False),), "warn"),
    ((GpuInfo(index=0, compute_capability=(8, 0), nvswitch=True),), "warn"),
    ((H100,), "ok"),
    ((GpuInfo(index=0, compute_capability=(9, 0), nvswitch=None),), "skip"),
])
def test_nccl_nvls_forced_on(tmp_path, gpus, verdict):
    c = one(hostchecks.check_nccl_nvls, make_host(tmp_path, env={"NCCL_NVLS_ENABLE": "1"}, gpus=gpus,
                                                  gpu_reason="no GPU: NVML cannot start"))
    assert c.verdict == verdict, c
    if gpus is None:
        assert "no GPU" in c.message
    assert one(hostchecks.check_nccl_nvls, make_host(tmp_path, env={"NCCL_NVLS_ENABLE": "0"}, gpus=gpus)
               ).verdict == "ok"


def test_nccl_debug_info_on_a_large_job_warns(tmp_path):
    host = make_host(tmp_path, env={"NCCL_DEBUG": "INFO"})
    c = one(hostchecks.check_nccl_debug, host, Options(nproc_per_node=8, nnodes=16))
    assert c.verdict == "warn" and "128 ranks" in c.message
    assert one(hostchecks.check_nccl_debug, make_host(tmp_path, env={"NCCL_DEBUG": "trace", "WORLD_SIZE": "256"})
               ).verdict == "warn"
    assert one(hostchecks.check_nccl_debug, host, Options(nproc_per_node=8)).verdict == "ok"
    assert one(hostchecks.check_nccl_debug, host).verdict == "skip"  # world size unknown
    assert one(hostchecks.check_nccl_debug, make_host(tmp_path, env={"NCCL_DEBUG": "WARN"}),
               Options(nproc_per_node=8, nnodes=16)).verdict == "ok"


TWO_GPUS = (GpuInfo(index=0, uuid="GPU-aaaa"), GpuInfo(index=1, uuid="GPU-bbbb"))


@pytest.mark.parametrize("env, nproc, verdict", [
    ({}, 2, "ok"), ({}, 4, "warn"), ({"CUDA_VISIBLE_DEVICES": "1"}, 2, "warn"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-bbbb,0"}, 2, "ok"), ({"CUDA_VISIBLE_DEVICES": "0,7,1"}, 2, "warn"),
    ({"CUDA_VISIBLE_DEVICES": ""}, 1, "warn"), ({"LOCAL_RANK": "2"}, None, "warn"), ({"LOCAL_RANK": "1"}, None, "ok"),
])
def test_gpu_count_against_ranks_per_node(tmp_path, env, nproc, verdict):
    c = one(hostchecks.check_gpu_count, make_host(tmp_path, env=env, gpus=TWO_GPUS), Options(nproc_per_node=nproc))
    assert c.verdict == verdict, c


def test_gpu_count_without_a_gpu_is_a_skip(tmp_path):
    c = one(hostchecks.check_gpu_count, make_host(tmp_path, gpus=None, gpu_reason="no GPU: NVML cannot start"),
            Options(nproc_per_node=8))
    assert c.verdict == "skip" and c.message.startswith("no GPU")


class NvlinkNvml(FakeNvml):
    """FakeNvml with the NVLink and name calls the doctor reads."""

    NVML_NVLINK_MAX_LINKS = 4

    def __init__(self, remote: int, **kw):
        super().__init__(**kw)
        self.remote = remote

    def nvmlDeviceGetName(self, handle):
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return (9, 0)

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link == 3:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return 1

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link):
        return self.remote


def test_read_gpus_from_nvml_and_without_it():
    gpus, _ = read_gpus(NvlinkNvml(remote=2, gpu_count=2))
    assert [(g.index, g.name, g.compute_capability, g.nvswitch) for g in gpus] == [
        (0, "NVIDIA H100 80GB HBM3", (9, 0), True), (1, "NVIDIA H100 80GB HBM3", (9, 0), True)]
    assert gpus[0].uuid.startswith("GPU-")
    assert {g.nvswitch for g in read_gpus(NvlinkNvml(remote=0, gpu_count=1))[0]} == {False}
    assert {g.nvswitch for g in read_gpus(FakeNvml(gpu_count=1))[0]} == {None}  # no NVLink calls: unknown
    gpus, reason = read_gpus(FakeNvml(init_error=FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert gpus is None and reason.startswith("no GPU")


# ---- filesystems ---------------------------------------------------------------------------


def test_mount_of_takes_the_longest_prefix_and_unescapes():
    mounts = ("/dev/vda / ext4 rw 0 0\nsrv:/home /home nfs4 rw 0 0\n/dev/vdb /home/local ext4 rw 0 0\n"
              "srv:/x /mnt/my\\040data lustre rw 0 0\n")
    assert fschecks.mount_of("/home/u/.triton", mounts) == ("/home", "nfs4")
    assert fschecks.mount_of("/home/local/x", mounts) == ("/home/local", "ext4")
    assert fschecks.mount_of("/home2/x", mounts) == ("/", "ext4")
    assert fschecks.mount_of("/mnt/my data/c", mounts) == ("/mnt/my data", "lustre")
    assert fschecks.is_network_fs("fuse.sshfs") and not fschecks.is_network_fs("fuse.lxcfs")


def test_triton_cache_on_a_network_filesystem_warns(tmp_path):
    shared = os.path.realpath(tmp_path / "shared")
    mounts = f"/dev/vda / ext4 rw 0 0\nsrv:/e {shared} nfs4 rw 0 0\n"
    host = make_host(tmp_path, env={"TRITON_CACHE_DIR": f"{shared}/triton"}, mounts=mounts)
    c = one(fschecks.check_triton_cache_fs, host)
    assert c.verdict == "warn" and "nfs4" in c.message and c.evidence["TRITON_CACHE_DIR"]["mount"] == shared
    assert one(fschecks.check_triton_cache_fs, make_host(tmp_path, env={"TRITON_CACHE_DIR": "/tmp/t"}, mounts=mounts)
               ).verdict == "ok"
    # the default (~/.triton/cache) is read under the home directory
    home_nfs = f"/dev/vda / ext4 rw 0 0\nsrv:/h {os.path.realpath(tmp_path / 'home')} fuse.sshfs rw 0 0\n"
    assert one(fschecks.check_triton_cache_fs, make_host(tmp_path, mounts=home_nfs)).verdict == "warn"
    assert one(fschecks.check_triton_cache_fs, make_host(tmp_path, mounts="")).verdict == "skip"


def test_torch_extensions_on_a_network_filesystem_warns(tmp_path):
    mounts = "/dev/vda / ext4 rw 0 0\nmds@tcp:/fs /lustre lustre rw 0 0\n"
    host = make_host(tmp_path, env={"TORCH_EXTENSIONS_DIR": "/lustre/u/ext"}, mounts=mounts)
    c = one(fschecks.check_extensions_cache_fs, host)
    assert c.verdict == "warn" and "lustre" in c.message and "TORCH_EXTENSIONS_DIR" in c.message
    assert one(fschecks.check_extensions_cache_fs, make_host(tmp_path, mounts=mounts)).verdict == "ok"


def test_stale_extension_build_lock_warns(tmp_path):
    ext = tmp_path / "ext"
    lock = ext / "py311_cu121" / "fused_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    host = make_host(tmp_path, env={"TORCH_EXTENSIONS_DIR": str(ext)}, now=lambda: lock.stat().st_mtime + 3600)
    c = one(fschecks.check_stale_extension_lock, host)
    assert c.verdict == "warn" and str(lock) in c.message and c.evidence["stale_locks"][0]["age_s"] == 3600
    fresh = make_host(tmp_path, env={"TORCH_EXTENSIONS_DIR": str(ext)}, now=lambda: lock.stat().st_mtime + 60)
    assert one(fschecks.check_stale_extension_lock, fresh).verdict == "ok"
    assert one(fschecks.check_stale_extension_lock, make_host(tmp_path)).verdict == "ok"  # no extensions dir


# ---- checkpoints -------------------------------------------------------------------------


def write_ckpt(root: Path, step: int, manifest: dict | bytes, *, kind: str = "") -> Path:
    path = root / f"step-{step:08d}{kind}"
    path.mkdir(parents=True)
    (path / "state.pt").write_bytes(b"x" * 1000)
    (path / "manifest.json").write_bytes(manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode())
    return path


def test_checkpoint_space_for_two_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_ckpt(ckpt, 5, {"files": {"state.pt": {"bytes": 1 << 20}}})
    newest = write_ckpt(ckpt, 10, {"files": {"state.pt": {"bytes": GIB, "sha256": "0"}}})
    write_ckpt(ckpt, 9, {"files": {"state-rank1.pt": {"bytes": 7}}}, kind="-emergency-r1")
    opts = Options(ckpt_dir=ckpt)
    for free, verdict in [(3 * GIB, "ok"), (GIB + GIB // 2, "warn"), (GIB // 2, "fail")]:
        c = one(fschecks.check_checkpoint_space, make_host(tmp_path, statvfs=statvfs_of({}, (free, 10 * GIB))), opts)
        assert c.verdict == verdict and c.evidence["checkpoint"] == str(newest) and c.evidence["checkpoint_bytes"] == GIB
    assert one(fschecks.check_checkpoint_space, make_host(tmp_path), Options(ckpt_dir=tmp_path / "none")
               ).verdict == "skip"
    assert one(fschecks.check_checkpoint_space, make_host(tmp_path)).verdict == "skip"


def test_checkpoint_space_without_a_manifest_counts_the_files(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_ckpt(ckpt, 3, b"not json")
    c = one(fschecks.check_checkpoint_space, make_host(tmp_path, statvfs=statvfs_of({}, (1500, GIB))),
            Options(ckpt_dir=ckpt))
    assert c.verdict == "warn" and c.evidence["checkpoint_bytes"] == 1000 + len(b"not json")


@pytest.mark.parametrize("env, gpus, save_s, verdict", [
    ({}, (H100,), 700, "fail"),          # NCCL default 600 s
    ({}, None, 700, "ok"),               # gloo default 1800 s
    ({}, None, 1000, "warn"),            # over half of it
    ({"TORCH_DISTRIBUTED_TIMEOUT": "3600"}, (H100,), 700, "ok"),
    ({"DEEPSPEED_TIMEOUT": "5"}, None, 200, "warn"),   # minutes
    ({"NCCL_TIMEOUT": "soon"}, None, 10, "warn"),
])
def test_collective_timeout_shorter_than_the_last_checkpoint(tmp_path, env, gpus, save_s, verdict):
    write_ckpt(tmp_path / "ckpt", 10, {"files": {}, "timing": {"save_s": save_s, "load_s": 1}})
    c = one(fschecks.check_collective_timeout, make_host(tmp_path, env=env, gpus=gpus),
            Options(ckpt_dir=tmp_path / "ckpt"))
    assert c.verdict == verdict, c


def test_collective_timeout_skips_without_recorded_timing(tmp_path):
    write_ckpt(tmp_path / "ckpt", 10, {"format": 1, "step": 10, "time": 1.7e9, "files": {}})
    c = one(fschecks.check_collective_timeout, make_host(tmp_path), Options(ckpt_dir=tmp_path / "ckpt"))
    assert c.verdict == "skip" and "records no save/load time" in c.message
    assert one(fschecks.check_collective_timeout, make_host(tmp_path)).verdict == "skip"
    assert one(fschecks.check_collective_timeout, make_host(tmp_path), Options(ckpt_dir=tmp_path / "empty")
               ).verdict == "skip"


# ---- shared memory and limits ---------------------------------------------------------------


@pytest.mark.parametrize("free, total, nproc, verdict", [
    (64 << 20, 64 << 20, 1, "warn"), (16 * GIB, 16 * GIB, 8, "ok"), (GIB, 16 * GIB, 8, "warn"),
])
def test_dev_shm_size(tmp_path, free, total, nproc, verdict):
    host = make_host(tmp_path, statvfs=statvfs_of({"/dev/shm": (free, total)}))
    c = one(fschecks.check_shm_size, host, Options(nproc_per_node=nproc))
    assert c.verdict == verdict and c.evidence["total_bytes"] == total


def test_core_ulimit_unlimited_on_a_big_job_warns(tmp_path):
    unlimited = make_host(tmp_path, getrlimit=lambda res: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    c = one(fschecks.check_core_ulimit, unlimited, Options(nproc_per_node=8, nnodes=2))
    assert c.verdict == "warn" and c.evidence["soft"] == "unlimited"
    assert one(fschecks.check_core_ulimit, unlimited, Options(nproc_per_node=2)).verdict == "ok"
    assert one(fschecks.check_core_ulimit, make_host(tmp_path), Options(nproc_per_node=64)).verdict == "ok"


def test_nofile_ulimit_low_warns(tmp_path):
    low = make_host(tmp_path, getrlimit=lambda res: (1024, 4096))
    c = one(fschecks.check_nofile_ulimit, low)
    assert c.verdict == "warn" and "ulimit -n" in c.message and c.evidence["soft"] == 1024
    assert one(fschecks.check_nofile_ulimit, make_host(tmp_path)).verdict == "ok"


# ---- all checks together --------------------------------------------------------------------


def test_every_check_runs_once_with_a_kebab_id_and_a_runbook(tmp_path):
    checks = doctor.run_checks(make_host(tmp_path), Options())
    ids = [c.id for c in checks]
    assert len(ids) == len(set(ids)) == len(doctor.CHECKS) >= 12
    assert all(c.id.replace("-", "").isalnum() and c.id.islower() for c in checks)
    for c in checks:
        get_runbook(c.runbook)
    json.dumps([c.to_json() for c in checks])


def test_a_check_that_breaks_is_a_skip_not_a_traceback(tmp_path):
    def statvfs(path):
        raise RuntimeError("boom")

    checks = by_id(make_host(tmp_path, statvfs=statvfs), Options(nproc_per_node=1))
    assert checks["shm-size"].verdict == "skip" and "boom" in checks["shm-size"].message


def test_checks_are_fast_on_this_machine():
    host = doctor.real_host(None, "no GPU")
    best = min(_timed(host) for _ in range(3))
    assert best < 0.2, best


def _timed(host: Host) -> float:
    t0 = time.perf_counter()
    doctor.run_checks(host, Options(nproc_per_node=2))
    return time.perf_counter() - t0


def test_main_exit_code_and_json(tmp_path, capsys):
    bad = make_host(tmp_path, env={"NCCL_SOCKET_IFNAME": "nosuchif0"})
    assert doctor.main(["--json"], host=bad) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and {"id", "verdict", "evidence", "message", "runbook"} <= set(out["checks"][0])
    assert doctor.main([], host=make_host(tmp_path)) == 0
    text = capsys.readouterr().out.splitlines()
    assert len(text) == len(doctor.CHECKS) + 1 and text[-1].startswith("doctor: ")


# ---- hostile input ------------------------------------------------------------------------

hostile = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])


@hostile
@given(st.one_of(st.text(), st.binary().map(lambda b: b.decode("utf-8", "replace")),
                 st.lists(st.tuples(st.sampled_from(["/", "/home", "/tmp", "\\040", "/a b", ""]),
                                    st.sampled_from(["nfs", "fuse.x", "ext4", "", "\x00"]))
                          ).map(lambda rows: "\n".join(f"d {p} {t} rw 0 0" for p, t in rows))))
def test_any_mount_table_gives_a_verdict(tmp_path, mounts):
    host = make_host(tmp_path, mounts=mounts, env={"TORCH_EXTENSIONS_DIR": "/home/x"})
    for check in (fschecks.check_triton_cache_fs, fschecks.check_extensions_cache_fs):
        one(check, host)


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
                      st.sampled_from([10**400, -1, "1e999", "NaN", float("inf")]))
json_doc = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(["files", "bytes", "timing", "save_s", "load_s", "state.pt", "x"]), inner,
                    max_size=4)), max_leaves=10)


@hostile
@given(st.one_of(st.binary(max_size=200), json_doc.map(lambda v: json.dumps(v).encode()),
                 st.integers(30, 3000).map(lambda n: b'{"timing":' * n + b"1" + b"}" * n)))
def test_any_manifest_gives_a_verdict(tmp_path, manifest):
    ckpt = tmp_path / f"ckpt-{time.monotonic_ns()}"
    write_ckpt(ckpt, 1, manifest)
    for check in (fschecks.check_collective_timeout, fschecks.check_checkpoint_space):
        one(check, make_host(tmp_path, gpus=(H100,)), Options(ckpt_dir=ckpt))


# ---- the command ----------------------------------------------------------------------------


def test_doctor_json_on_this_machine(tmp_path):
    r = trainwatch(tmp_path, "doctor", "--json", "--nproc-per-node", "2", timeout=60)
    assert r.returncode in (0, 1), r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is (r.returncode == 0) and len(out["checks"]) == len(doctor.CHECKS)
    assert all(c["verdict"] in hostchecks.VERDICTS for c in out["checks"])
    assert "Traceback" not in r.stderr


def test_doctor_human_form_on_this_machine(tmp_path):
    r = trainwatch(tmp_path, "doctor", timeout=60)
    lines = r.stdout.splitlines()
    assert r.returncode in (0, 1) and lines[-1].startswith("doctor: ") and len(lines) == len(doctor.CHECKS) + 1


@pytest.mark.parametrize("args, extra, needle", [
    (["--ckpt-dir", "README.md"], {}, "--ckpt-dir"),
    (["--ckpt-dir", "README.md/sub"], {}, "--ckpt-dir"),
    ([], {"TRAINWATCH_CKPT_DIR": "README.md"}, "TRAINWATCH_CKPT_DIR"),
    (["--nproc-per-node", "two"], {}, "--nproc-per-node"),
    (["--nproc-per-node", "0"], {}, "--nproc-per-node"),
    (["--nnodes", "x:y"], {}, "--nnodes"),
    (["--bogus"], {}, "unrecognized"),
])
def test_doctor_bad_input_is_one_line_exit_2(tmp_path, args, extra, needle):
    r = trainwatch(tmp_path, "doctor", *args, timeout=60, **extra)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.slow
def test_launch_prints_the_doctor_warning_and_still_runs(tmp_path):
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "1", "--job", "doctor-warn", str(SCRIPTS / "plain_ddp.py"),
                   "--steps", "2", NCCL_SOCKET_IFNAME="nosuchif0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[trainwatch] doctor: nccl-socket-ifname: NCCL_SOCKET_IFNAME=nosuchif0" in r.stdout
    assert job_json(tmp_path, "doctor-warn")["status"] == "succeeded"


@pytest.mark.slow
def test_launch_strict_refuses_a_failing_check_before_any_rank(tmp_path):
    r = trainwatch(tmp_path, "launch", "--strict", "--nproc-per-node", "1", "--job", "doctor-strict",
                   str(SCRIPTS / "plain_ddp.py"), "--steps", "2", NCCL_SOCKET_IFNAME="nosuchif0",
                   GLOO_SOCKET_IFNAME="nosuchif1")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(lines) == 2 and all(line.startswith("error: doctor: ") for line in lines), r.stderr
    assert any("nccl-socket-ifname" in line for line in lines) and any("gloo-socket-ifname" in line for line in lines)
    assert "Traceback" not in r.stdout + r.stderr
    job = tmp_path / "jobs" / "doctor-strict"
    assert not (job / "telemetry.json").exists() and not (job_json(tmp_path, "doctor-strict") or {}).get("ranks")
