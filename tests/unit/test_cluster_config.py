"""The several-hosts flags and key files: one-line refusals naming the flag, each node's ranks,
the endpoints, and the CURVE key files `lorad keys` writes (secrets 0600, never overwritten).
"""

from __future__ import annotations

import os
import stat

import pytest

from lorad.config import ConfigError, WorkerConfig
from lorad.config.cli import parse_args
from lorad.config.cluster import ClusterConfig
from lorad.daemon import keys_command
from lorad.protocol.curve import KeyCheck, client_keys, read_authorized, server_keys

CLUSTER = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--cluster-key-dir", "/k"]


def _refusal(capsys, argv: list[str], node: bool = False) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model", "/m", *argv], node=node)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


@pytest.mark.parametrize("argv, node, wanted", [
    (["--master-addr", "10.0.0.1"], False, "--master-addr 10.0.0.1 needs --nnodes 2"),
    (["--cluster-key-dir", "/k"], False, "--cluster-key-dir /k needs --nnodes 2"),
    (["--nnodes", "2", "--parallel", "2"], False, "--nnodes 2 needs --master-addr"),
    (["--nnodes", "2", "--master-addr", "10.0.0.1"], False, "needs --cluster-key-dir"),
    ([*CLUSTER, "--parallel", "3"], False, "--parallel 3 does not split evenly over --nnodes 2"),
    ([*CLUSTER[:2], "--master-addr", "0.0.0.0", *CLUSTER[4:]], False, "not the wildcard"),
    ([*CLUSTER[:2], "--master-addr", "node0.lan", *CLUSTER[4:]], False,
     "--master-addr must be an IP address of the host, got 'node0.lan'"),
    ([*CLUSTER, "--parallel", "2", "--node-rank", "1"], False,
     "run `lorad node --node-rank 1 ...` on that host"),
    ([*CLUSTER, "--parallel", "2", "--node-rank", "2"], True, "--node-rank must be 0..1"),
    ([*CLUSTER, "--parallel", "2"], True, "lorad node needs --nnodes 2 or more and --node-rank"),
    ([*CLUSTER, "--parallel", "2", "--master-port", "65534"], False, "--master-port must be"),
    (["--node-addr", "10.0.0.2"], False, "--node-addr 10.0.0.2 needs --nnodes 2"),
    ([*CLUSTER, "--parallel", "2", "--node-addr", "::"], False, "--node-addr must be an "
     "address of the host, not the wildcard ::"),
])
def test_bad_cluster_flags_are_refused_naming_the_flag(capsys, argv, node, wanted):
    assert wanted in _refusal(capsys, argv, node)


def test_one_host_is_unchanged():
    config = parse_args(["--model", "/m", "--parallel", "2"])
    assert config.cluster == ClusterConfig()
    assert not config.cluster.multi_host
    assert list(config.cluster.local_ranks(2)) == [0, 1]


def test_ranks_and_endpoints_of_each_node():
    config = parse_args(["--model", "/m", *CLUSTER, "--parallel", "4", "--node-rank", "1",
                         "--master-port", "4000"], node=True)
    cluster = config.cluster
    assert (cluster.nnodes, cluster.node_rank, cluster.master_port) == (2, 1, 4000)
    assert list(cluster.local_ranks(4)) == [2, 3]
    assert cluster.node_of(1, 4) == 0 and cluster.node_of(2, 4) == 1
    assert cluster.endpoint(0) == "tcp://10.0.0.1:4000"
    assert cluster.instance_id == "cluster@10.0.0.1:4000"
    default = parse_args(["--model", "/m", *CLUSTER, "--parallel", "2"]).cluster
    assert default.master_port == 29500 and default.node_rank == 0
    # gloo's pairs: node 0 on --master-addr, another node where torch puts them unless told
    assert default.gloo_addr == "10.0.0.1" and cluster.gloo_addr is None
    told = parse_args(["--model", "/m", *CLUSTER, "--parallel", "4", "--node-rank", "1",
                       "--node-addr", "10.0.0.2"], node=True).cluster
    assert told.gloo_addr == "10.0.0.2"
    assert ClusterConfig().gloo_addr is None


def test_lorad_keys_writes_pairs_with_private_secrets(tmp_path, capsys):
    root = tmp_path / "keys"
    assert keys_command.main([str(root), "--coordinator"]) == 0
    for name in ("node", "coordinator"):
        assert stat.S_IMODE((root / f"{name}.secret").stat().st_mode) == 0o600
        assert len((root / f"{name}.key").read_text().strip()) == 40
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    node_key = (root / "node.key").read_bytes().strip()
    assert read_authorized(root / "authorized_keys") == {node_key}
    (root / "coordinator.key").rename(root / "server.key")
    with pytest.raises(SystemExit):  # node.key exists: never overwritten
        keys_command.main([str(root)])
    assert "node.key exists" in capsys.readouterr().err
    keys = server_keys(str(root))
    assert keys.authorized == {node_key}


def test_key_files_are_checked(tmp_path):
    keys_command.main([str(tmp_path / "k")])
    root = tmp_path / "k"
    with pytest.raises(ConfigError, match="coordinator.key"):  # not copied from node 0 yet
        client_keys(str(root))
    (root / "coordinator.key").write_text("too short\n")
    with pytest.raises(ConfigError, match="does not hold a Z85 CURVE key"):
        client_keys(str(root))
    os.chmod(root / "node.secret", 0o640)
    with pytest.raises(ConfigError, match="readable by others; chmod 600"):
        client_keys(str(root))


def test_authorized_keys_may_hold_comments_and_keys_with_a_hash(tmp_path):
    key = b"0000#" * 8  # a Z85 key may hold a '#'
    path = tmp_path / "authorized_keys"
    path.write_bytes(b"# node 0\n\n" + key + b" node 1\n")
    assert read_authorized(path) == {key}
    path.write_bytes(b"not-a-key\n")
    with pytest.raises(ConfigError, match="line 1 does not hold"):
        read_authorized(path)
    path.write_bytes(b"# nobody\n")
    with pytest.raises(ConfigError, match="lists no key"):
        read_authorized(path)


def test_the_key_check_admits_listed_keys_and_logs_a_refusal_once(caplog):
    check = KeyCheck(frozenset({b"a" * 40}))
    assert check.callback("lorad", b"a" * 40)
    assert not check.callback("lorad", b"b" * 40)
    assert not check.callback("lorad", b"b" * 40)
    refusals = [r for r in caplog.records if "refused a connection" in r.message]
    assert len(refusals) == 1 and "b" * 40 in refusals[0].message


def test_messages_that_name_ranks_can_name_their_hosts():
    assert ClusterConfig().hosts_of_ranks(2) == ""
    cluster = ClusterConfig(2, 0, "10.0.0.1", 4000, "/k")
    assert cluster.hosts_of_ranks(4) == \
        " [node 0 (coordinator): ranks 0..1; node 1 (lorad node): ranks 2..3]"


def _worker_config(**cluster) -> WorkerConfig:
    return WorkerConfig("/m", 4, "auto", "cpu", "gloo", 64, None, 512, 16, None, None, 1,
                        "/run/x", "id", 1, **cluster)


def test_one_host_keeps_ipc_and_a_file_store_several_use_tcp_on_the_master_addr():
    one = _worker_config()
    assert (one.admit_endpoint, one.results_endpoint, one.dist_init_method) == (
        "ipc:///run/x/admit.sock", "ipc:///run/x/results.sock", "file:///run/x/dist.store")
    assert list(one.local_ranks) == [0, 1, 2, 3]
    node1 = _worker_config(nnodes=2, node_rank=1, master_addr="fd00::1", master_port=4000,
                           cluster_key_dir="/k")
    assert (node1.admit_endpoint, node1.results_endpoint, node1.dist_init_method) == (
        "tcp://[fd00::1]:4001", "tcp://[fd00::1]:4002", "tcp://[fd00::1]:4000")
    assert list(node1.local_ranks) == [2, 3]
    assert WorkerConfig.from_json(node1.to_json()) == node1


@pytest.mark.parametrize("argv", [["node", "--model", "/m"],
                                  ["node", "--model", "/m", *CLUSTER, "--node-rank", "0"]])
def test_lorad_node_without_a_node_rank_is_refused(capsys, argv):
    from lorad.daemon.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("lorad node: error: lorad node needs --nnodes 2")


def test_node_0_without_its_key_files_is_refused_before_anything_starts(tmp_path, capsys):
    from lorad.daemon.main import main

    keys_command.main([str(tmp_path / "k")])  # a node pair only: no coordinator.secret
    capsys.readouterr()
    code = main(["--model", str(tmp_path / "no-model"), "--parallel", "2", "--nnodes", "2",
                 "--master-addr", "127.0.0.2", "--cluster-key-dir", str(tmp_path / "k")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("lorad: error: --cluster-key-dir: cannot read ") and \
        "coordinator.secret" in err
