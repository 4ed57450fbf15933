"""deploy/ as a user gets it: Redis configs a real redis-server loads (with noeviction),
an ACL that lets idem work and nothing more, an env.example that is IdemConfig,
Kubernetes manifests that fit together, scripts that parse.

Redis checks start ``redis-server <conf>`` with overrides that keep it on loopback, in
a temporary directory, in the foreground. The only line rewritten in a copied config
is ``dir``: Redis changes into that directory while it parses the line, before any
command-line override applies, so a production path missing here would abort it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from idem.acl import acl_user_line, producer_user_line
from idem.cli import main as idem_main
from idem.config import IdemConfig
from idem.redis_server import free_port, redis_server_binary

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
REDIS_DIR = DEPLOY / "redis"
USERS_ACL = REDIS_DIR / "users.acl"
K8S = DEPLOY / "spark" / "kubernetes"
SOURCES = ("idem", "retry", "spark")
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
K8S_REDIS_CONF = "spark/kubernetes/manifests/redis.yaml#redis.conf"
DATA_CONFS = [
    *(
        str(p.relative_to(DEPLOY))
        for p in sorted(REDIS_DIR.rglob("*.conf"))
        if p.name != "sentinel.conf"
    ),  # a Sentinel stores no data
    K8S_REDIS_CONF,
]
SETTINGS = {f"IDEM_{f.name.upper()}" for f in dataclasses.fields(IdemConfig)}
GROUP_USER = "idem-orders"
"""The shipped ACL user of group ``orders``: the rights every group's user has."""
REFUSED_ON_PURPOSE = {"config get"}
"""Commands idem sends that a group's user lacks by design (it reveals every setting,
``masterauth`` too); idem logs a warning without it."""


# --- helpers -------------------------------------------------------------------------


def _require(binary: str) -> str:
    path = redis_server_binary() if binary == "redis-server" else shutil.which(binary)
    if path is None:
        message = f"{binary} is not installed (apt-get install redis-server): deploy/ needs it"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return path


def _module(name: str, package: str) -> Any:
    """An optional test dependency (in the ``dev`` extra): missing in CI is a failure."""
    reason = f"pip install {package} (in the dev extra): the deploy checks need it"
    if IN_CI:
        try:
            return importlib.import_module(name)
        except ImportError:
            pytest.fail(reason, pytrace=False)
    return pytest.importorskip(name, reason=reason)


def _manifests() -> list[tuple[Path, dict[str, Any]]]:
    yaml = _module("yaml", "pyyaml")
    return [
        (path, doc)
        for path in sorted(DEPLOY.rglob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc is not None
    ]


def _k8s(kind: str, name: str) -> dict[str, Any]:
    for _, doc in _manifests():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name!r} in deploy/")


def _k8s_acl() -> str:
    return str(_k8s("Secret", "idem-redis-acl")["stringData"]["users.acl"])


def _conf_text(name: str) -> str:
    if name == K8S_REDIS_CONF:
        return str(_k8s("ConfigMap", "idem-redis-config")["data"]["redis.conf"])
    return (DEPLOY / name).read_text()


def _acl_user(acl_text: str, user: str) -> list[str]:
    """The rules of ``user`` in an ACL file."""
    for line in acl_text.splitlines():
        if line.split()[:2] == ["user", user]:
            return line.split()[2:]
    raise AssertionError(f"no user {user!r} in the ACL file")


def _password(acl_text: str, user: str) -> str:
    return next(rule[1:] for rule in _acl_user(acl_text, user) if rule.startswith(">"))


def _client(port: int, acl_text: str | None, user: str = "admin") -> redis.Redis:
    if acl_text is None:
        return redis.Redis(port=port, decode_responses=True)
    return redis.Redis(
        port=port, username=user, password=_password(acl_text, user), decode_responses=True
    )


def _wait(what: str, check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError):
            if check():
                return
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def _ping_reply(port: int) -> bytes:
    """The raw answer to an unauthenticated PING (b"" when nothing answers)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64)
    except OSError:
        return b""


def _free_port_block(count: int) -> int:
    """A base port whose next ``count`` ports and their cluster bus ports (+10000) are free."""

    def bindable(port: int) -> bool:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    for _ in range(50):
        base = free_port() % 20000 + 20000
        if all(bindable(p) for b in range(base, base + count) for p in (b, b + 10000)):
            return base
    pytest.fail("no block of free loopback ports for the cluster")


@contextlib.contextmanager
def _serve(
    conf_text: str, workdir: Path, *, acl_text: str | None = None, extra: tuple[str, ...] = ()
) -> Iterator[int]:
    """Run redis-server from ``conf_text`` on a free loopback port; yield the port."""
    binary = _require("redis-server")
    workdir.mkdir(parents=True)
    conf = workdir / "redis.conf"
    conf.write_text(re.sub(r"(?m)^dir .*$", f'dir "{workdir}"', conf_text))
    port = _free_port_block(1) if "cluster-enabled yes" in conf_text else free_port()
    args = [binary, str(conf), *extra, "--port", str(port), "--bind", "127.0.0.1"]
    args += ["--dir", str(workdir), "--daemonize", "no", "--logfile", str(workdir / "log")]
    if acl_text is not None:
        (workdir / "users.acl").write_text(acl_text)
        args += ["--aclfile", str(workdir / "users.acl")]
    with (workdir / "stderr").open("wb") as stderr:
        proc = subprocess.Popen(args, stdout=stderr, stderr=stderr)
    try:
        deadline = time.monotonic() + 15
        while not _ping_reply(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (workdir / "log").read_text() if (workdir / "log").exists() else ""
                pytest.fail(
                    f"redis-server did not start from {conf_text[:60]!r}...:\n"
                    f"{(workdir / 'stderr').read_text()}{log[-2000:]}"
                )
            time.sleep(0.02)
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=10)


# --- Redis configurations ------------------------------------------------------------


@pytest.mark.unit
def test_every_redis_data_config_states_noeviction_aof_and_a_memory_limit() -> None:
    for name in DATA_CONFS:
        lines = [line.split(None, 1) for line in _conf_text(name).splitlines()]
        settings = {words[0]: words[1] for words in lines if words and words[0][0] != "#"}
        # Redis's default is noeviction too: the file must say it, so an edit shows.
        assert settings.get("maxmemory-policy") == "noeviction", name
        assert (settings.get("appendonly"), settings.get("appendfsync")) == ("yes", "everysec")
        assert settings.get("maxmemory", "0") != "0", name


@pytest.mark.integration
@pytest.mark.parametrize("name", DATA_CONFS)
def test_redis_config_loads_in_redis_server_with_noeviction(name: str, tmp_path: Path) -> None:
    text = _conf_text(name)
    acl = None
    if "aclfile" in text:
        acl = _k8s_acl() if name == K8S_REDIS_CONF else USERS_ACL.read_text()
    # A replica's placeholder primary is not on loopback: keep it unreplicated here.
    extra = ("--replicaof", "no", "one") if "replicaof" in text else ()
    with _serve(text, tmp_path / "redis", acl_text=acl, extra=extra) as port:
        client = _client(port, acl)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        client.close()


@pytest.mark.unit
def test_shipped_passwords_are_placeholders() -> None:
    texts = [p.read_text() for p in DEPLOY.rglob("*") if p.is_file()]
    secrets = re.findall(r"(?m)^user \S+ .*?>(\S+)", USERS_ACL.read_text() + _k8s_acl())
    secrets += [s for t in texts for s in re.findall(r"(?:masterauth|auth-pass \S+) (\S+)", t)]
    secrets += [s for t in texts for s in re.findall(r"rediss?://[^:@/\s]+:([^@\s]+)@", t)]
    assert len(secrets) >= 6
    assert all(s.startswith(("CHANGE-ME", "<", "...")) for s in secrets), secrets


@pytest.mark.unit
def test_shipped_group_users_are_what_idem_acl_user_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    acl = USERS_ACL.read_text()
    for group in ("orders", "payments"):
        assert idem_main(["acl", "user", "--group", group, "--topic", group]) == 0
        printed = capsys.readouterr().out.split()
        assert _acl_user(acl, f"idem-{group}") == printed[2:]
        assert printed[2:] == acl_user_line(group, topics=[group]).split()[2:]
    producer = producer_user_line("idem-producer", topics=["orders", "payments"])
    assert _acl_user(acl, "idem-producer") == producer.split()[2:]


@pytest.mark.unit
def test_readme_names_every_command_the_idem_user_has() -> None:
    readme = (DEPLOY / "README.md").read_text()
    commands = [
        r[1:].upper().replace("|", " ")
        for r in _acl_user(USERS_ACL.read_text(), GROUP_USER)
        if r.startswith("+")
    ]
    assert [c for c in commands if f"`{c}`" not in readme] == []


@pytest.mark.integration
def test_idem_acl_user_can_do_idems_work_and_nothing_destructive(tmp_path: Path) -> None:
    acl = USERS_ACL.read_text()
    with _serve(_conf_text("redis/redis-single.conf"), tmp_path / "r", acl_text=acl) as port:
        idem = _client(port, acl, GROUP_USER)
        key, meta, queue = "idem:{orders:3}:k:ORDERID_100", "idem:{orders:3}:wm", "rmq:{orders}:q"
        stream = "rmq:{orders}:%RETRY%orders"
        assert idem.set(key, "C", px=60_000)
        assert idem.mget([key, key]) == ["C", "C"]
        assert idem.pexpire(key, 30_000)
        assert idem.delete(key) == 1
        assert idem.hincrby(meta, "version", 7) == 7
        assert idem.hgetall(meta) == {"version": "7"}
        idem.zadd(queue, {"m1": 1000})
        assert idem.zrange(queue, 0, -1) == ["m1"]
        assert idem.zpopmin(queue) == [("m1", 1000.0)]
        idem.xgroup_create(stream, "orders", id="0", mkstream=True)
        msg_id = idem.xadd(stream, {"m": "{}"})
        assert idem.xreadgroup("orders", "c1", {stream: ">"})[0][1][0][0] == msg_id
        assert idem.xpending(stream, "orders")["pending"] == 1
        idem.xautoclaim(stream, "orders", "c2", min_idle_time=0)
        assert idem.xack(stream, "orders", msg_id) == 1
        assert idem.xdel(stream, msg_id) == 1
        assert idem.publish("rmq:{orders}:schedule:wake", "wake") == 0
        claim = idem.register_script("return redis.call('SET', KEYS[1], ARGV[1], 'NX')")
        assert claim(keys=[key], args=["P"]) == "OK"
        for transaction in (False, True):  # SCRIPT EXISTS + EVALSHA, and MULTI/EXEC
            pipe = idem.pipeline(transaction=transaction)
            claim(keys=[f"idem:{{orders:4}}:a{transaction}"], args=["x"], client=pipe)
            claim(keys=[f"idem:{{orders:4}}:b{transaction}"], args=["x"], client=pipe)
            assert pipe.execute() == ["OK", "OK"]
        refused: list[Callable[[], object]] = [
            idem.flushall,
            lambda: idem.keys("*"),
            lambda: idem.config_set("maxmemory-policy", "allkeys-lru"),
            lambda: idem.config_get("masterauth"),
            lambda: idem.scan(0),
            lambda: idem.get("someone-else:key"),
            lambda: idem.get("idem:{payments:3}:wm"),  # another group's
            lambda: idem.publish("rmq:{payments}:schedule:wake", "wake"),
            lambda: idem.eval("return redis.call('DEL', KEYS[1])", 1, "someone-else:key"),
            lambda: idem.execute_command("SHUTDOWN"),
        ]
        for command in refused:
            with pytest.raises(redis.exceptions.NoPermissionError):
                command()
        assert _ping_reply(port).startswith(b"-NOAUTH")  # the default user is off
        idem.close()


def _redis_py_command(method: str, *, depth: int = 1) -> tuple[str, ...] | None:
    """``("config", "get")`` for ``config_get``: read off redis-py's own method (or, for a
    helper such as ``scan_iter``, off the method it calls: ``scan``)."""
    function = getattr(redis.Redis, method, None)
    try:
        source = inspect.getsource(function) if callable(function) else ""
    except (OSError, TypeError):
        return None
    match = re.search(r'execute_command\(\s*"([A-Z][A-Z ]*)"', source)
    if match:
        return tuple(match.group(1).lower().split())
    if depth > 0:
        for called in re.findall(r"\bself\.(\w+)\(", source):
            found = _redis_py_command(called, depth=depth - 1)
            if found is not None:
                return found
    return None


def _commands_idem_sends() -> dict[tuple[str, ...], str]:
    """Every Redis command in idem's Lua scripts and redis-py client calls -> where."""
    containers = {"xgroup", "xinfo", "object", "config", "client", "memory", "script"}
    call = re.compile(r"redis\.p?call\(\s*['\"](\w+)['\"]\s*(?:,\s*['\"](\w+)['\"])?")
    found: dict[tuple[str, ...], str] = {}
    for path in sorted(p for d in SOURCES for p in (ROOT / d).rglob("*.lua")):
        for name, sub in call.findall(path.read_text()):
            command = (name.lower(), sub.lower()) if name.lower() in containers else (name,)
            found.setdefault(tuple(c.lower() for c in command if c), str(path.relative_to(ROOT)))
    for path in sorted(p for d in SOURCES for p in (ROOT / d).rglob("*.py")):
        for method in re.findall(r"\b(?:client|pipe|pipeline)\.(\w+)\(", path.read_text()):
            sent = _redis_py_command(method)
            if sent is not None:
                found.setdefault(sent, f"{path.relative_to(ROOT)} ({method})")
    return found


@pytest.mark.integration
def test_example_acl_allows_every_command_idem_sends(tmp_path: Path) -> None:
    commands = _commands_idem_sends()
    assert ("config", "get") in commands, "the start-up eviction check was not found"
    acl = USERS_ACL.read_text()
    with _serve(_conf_text("redis/redis-single.conf"), tmp_path / "r", acl_text=acl) as port:
        admin = _client(port, acl)
        refused = {}
        for command, where in sorted(commands.items()):
            # Pad with a name of the group (a key and a channel) until the arity fits;
            # DRYRUN then checks command, keys and channels.
            for padding in range(10):
                args = [*command, *["rmq:{orders}:k"] * padding]
                try:
                    answer = admin.execute_command("ACL", "DRYRUN", GROUP_USER, *args)
                except redis.ResponseError as exc:
                    if "wrong number of arguments" in str(exc):
                        continue
                    answer = str(exc)
                if answer != "OK":
                    refused[" ".join(command)] = f"{answer} (used in {where})"
                break
        admin.close()
    unexpected = {c: why for c, why in refused.items() if c not in REFUSED_ON_PURPOSE}
    assert not unexpected, f"add to GROUP_COMMANDS in idem/acl.py: {unexpected}"
    assert ("scan",) not in commands, "SCAN lists every group's keys: a group's user lacks it"


@pytest.mark.integration
def test_primary_replica_and_sentinel_work_with_the_example_credentials(tmp_path: Path) -> None:
    acl = USERS_ACL.read_text()
    with contextlib.ExitStack() as stack:
        primary = stack.enter_context(
            _serve(_conf_text("redis/redis-single.conf"), tmp_path / "p", acl_text=acl)
        )
        replica = stack.enter_context(
            _serve(
                _conf_text("redis/redis-replica.conf"),
                tmp_path / "r",
                acl_text=acl,
                extra=("--replicaof", "127.0.0.1", str(primary)),
            )
        )
        on_replica = _client(replica, acl)
        _wait(
            "the replica to sync with masteruser/masterauth from redis-replica.conf",
            lambda: on_replica.info("replication")["master_link_status"] == "up",
        )
        _client(primary, acl, GROUP_USER).set("idem:{orders:0}:k", "COMPLETED")
        _wait(
            "the write to reach the replica",
            lambda: on_replica.get("idem:{orders:0}:k") == "COMPLETED",
        )
        sentinel_conf = re.sub(
            r"(?m)^(sentinel monitor \S+) \S+ \d+",
            rf"\1 127.0.0.1 {primary}",
            _conf_text("redis/sentinel.conf"),
        )
        sentinel = redis.Redis(
            port=stack.enter_context(_serve(sentinel_conf, tmp_path / "s", extra=("--sentinel",))),
            decode_responses=True,
        )

        def watching() -> bool:
            raw = sentinel.execute_command("SENTINEL", "MASTER", "idem-primary")
            state = dict(zip(raw[::2], raw[1::2], strict=True)) if isinstance(raw, list) else raw
            return state["flags"] == "master" and int(state["num-slaves"]) == 1

        _wait("Sentinel to see the primary and its replica (auth-user/auth-pass)", watching)
        on_replica.close()
        sentinel.close()


@pytest.mark.integration
def test_kubernetes_redis_accepts_the_url_in_the_secret(tmp_path: Path) -> None:
    url = urlsplit(_k8s("Secret", "idem-redis")["stringData"]["IDEM_REDIS_URL"])
    assert (url.hostname, url.port) == ("idem-redis", 6379), "the Service is idem-redis:6379"
    k8s_rules = _acl_user(_k8s_acl(), GROUP_USER)
    assert k8s_rules == _acl_user(USERS_ACL.read_text(), GROUP_USER), "same rights as users.acl"
    with _serve(_conf_text(K8S_REDIS_CONF), tmp_path / "k", acl_text=_k8s_acl()) as port:
        local = url._replace(netloc=f"{url.username}:{url.password}@127.0.0.1:{port}")
        client = redis.Redis.from_url(local.geturl(), decode_responses=True)
        assert client.hset("rmq:{orders}:live", "m", "S") == 1
        client.close()
        admin = _client(port, _k8s_acl())
        assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        admin.close()


@pytest.mark.integration
def test_create_cluster_script_builds_a_cluster_idem_can_use(tmp_path: Path) -> None:
    _require("redis-server")
    _require("redis-cli")
    script = REDIS_DIR / "cluster" / "create-cluster.sh"
    base = _free_port_block(6)
    env = {**os.environ, "BASE_PORT": str(base), "CLUSTER_DIR": str(tmp_path)}
    acl = USERS_ACL.read_text()
    try:
        started = subprocess.run(
            ["bash", str(script), "start"],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert started.returncode == 0, started.stdout + started.stderr
        for port in range(base, base + 6):
            with redis.Redis(port=port, decode_responses=True) as node:
                assert node.cluster("INFO")["cluster_state"] == "ok"
                assert node.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
                rules = _acl_user(acl, GROUP_USER)
                node.execute_command("ACL", "SETUSER", GROUP_USER, "reset", *rules)
        cluster = RedisCluster(
            startup_nodes=[ClusterNode("127.0.0.1", base)],
            username=GROUP_USER,
            password=_password(acl, GROUP_USER),
            decode_responses=True,
        )
        assert len(cluster.get_primaries()) == 3
        set_all = cluster.register_script(
            "for _, k in ipairs(KEYS) do redis.call('SET', k, ARGV[1]) end return #KEYS"
        )
        bucket = [f"idem:{{orders:3}}:k:ORDERID_{n}" for n in range(50)]
        assert set_all(keys=bucket, args=["P"]) == 50  # one bucket: one slot, one call
        with pytest.raises((redis.exceptions.RedisClusterException, redis.ResponseError)):
            set_all(keys=["idem:{orders:3}:k:a", "idem:{orders:4}:k:a"], args=["P"])
        move = cluster.register_script(  # a schedule queue -> %RETRY% move, as in retry/
            "redis.call('ZADD', KEYS[1], 1, 'm1'); redis.call('HSET', KEYS[2], 'm1', 'R')"
            " return redis.call('XADD', KEYS[3], '*', 'm', ARGV[1])"
        )
        assert move(
            keys=[
                "rmq:{orders}:SCHEDULE_TOPIC_XXXX:2",
                "rmq:{orders}:live",
                "rmq:{orders}:%RETRY%orders",
            ],
            args=["{}"],
        )
        cluster.close()
    finally:
        subprocess.run(
            ["bash", str(script), "stop"], env=env, capture_output=True, timeout=60, check=False
        )


# --- env.example ---------------------------------------------------------------------


def _source(text: str, tmp_path: Path) -> dict[str, str]:
    """The non-empty IDEM_* variables bash sets when it sources ``text`` with ``set -a``."""
    path = tmp_path / "env"
    path.write_text(text)
    out = subprocess.run(
        ["bash", "-c", f'set -a; . "{path}"; env -0'],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    pairs = (item.split("=", 1) for item in out.split("\0") if item.startswith("IDEM_"))
    return {name: value for name, value in pairs if value}


@pytest.mark.unit
def test_env_example_lists_every_idem_setting_exactly_once() -> None:
    text = (DEPLOY / "env.example").read_text()
    listed = Counter(re.findall(r"(?m)^#?\s*(IDEM_[A-Z_]+)=", text))
    assert set(listed) == SETTINGS
    assert [name for name, n in listed.items() if n > 1] == []


@pytest.mark.unit
def test_env_example_defaults_are_idems_defaults(tmp_path: Path) -> None:
    text = (DEPLOY / "env.example").read_text()
    environ = _source(re.sub(r"(?m)^# (IDEM_[A-Z_]+=)", r"\1", text), tmp_path)
    assert len(environ) == len(SETTINGS) - 3  # the three table paths stay unset
    assert IdemConfig.from_env(environ) == IdemConfig(group=environ["IDEM_GROUP"])


@pytest.mark.unit
def test_env_example_as_shipped_gives_a_working_config(tmp_path: Path) -> None:
    config = IdemConfig.from_env(_source((DEPLOY / "env.example").read_text(), tmp_path))
    assert config.group == "orders"
    assert Path(config.resolved_ledger_path).parts[-2:] == ("orders", "ledger")


# --- Kubernetes, Spark and shell -------------------------------------------------------


@pytest.mark.unit
def test_manifests_match_the_kubernetes_schema() -> None:
    manifests = _manifests()
    schema = _module("kubernetes_validate", "kubernetes-validate")
    for path, doc in manifests:
        try:
            schema.validate(doc, schema.latest_version(), strict=True)
        except schema.ValidationError as exc:
            pytest.fail(f"{path.relative_to(DEPLOY)}: {exc}")


@pytest.mark.unit
def test_manifests_parse_and_refer_only_to_objects_that_exist() -> None:
    manifests = [doc for _, doc in _manifests()]
    assert len(manifests) >= 8
    assert all(doc.get("apiVersion") and doc.get("kind") for doc in manifests)
    defined = {(doc["kind"], doc["metadata"]["name"]) for doc in manifests}
    for doc in manifests:
        if doc["kind"] not in {"Pod", "Deployment", "StatefulSet"}:
            continue
        template = doc if doc["kind"] == "Pod" else doc["spec"]["template"]
        spec, labels = template["spec"], template["metadata"]["labels"]
        volumes = spec.get("volumes", [])
        wanted = [("ConfigMap", v["configMap"]["name"]) for v in volumes if "configMap" in v]
        wanted += [("Secret", v["secret"]["secretName"]) for v in volumes if "secret" in v]
        for source in (s for c in spec["containers"] for s in c.get("envFrom", [])):
            if "configMapRef" in source:
                wanted.append(("ConfigMap", source["configMapRef"]["name"]))
            if "secretRef" in source:
                wanted.append(("Secret", source["secretRef"]["name"]))
        assert [w for w in wanted if w not in defined] == [], doc["metadata"]["name"]
        if doc["kind"] != "Pod":
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
        if doc["kind"] == "StatefulSet":
            service = _k8s("Service", doc["spec"]["serviceName"])
            assert service["spec"]["selector"].items() <= labels.items()
    submit = (K8S / "spark-submit-k8s.sh").read_text()
    assert ("ServiceAccount", "spark") in defined
    assert "serviceAccountName=spark " in submit
    containers = set(re.findall(r"podTemplateContainerName=(\S+)", submit))
    assert containers == {_k8s("Pod", "idem-spark-pod-template")["spec"]["containers"][0]["name"]}


def _schedule_command() -> list[str]:
    deployment = _k8s("Deployment", "idem-schedule-orders")
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["command"])


@pytest.mark.unit
def test_settings_configmap_is_a_valid_idem_config_for_the_scheduled_group() -> None:
    data = _k8s("ConfigMap", "idem-settings")["data"]
    settings = {name: value for name, value in data.items() if name.startswith("IDEM_")}
    assert set(settings) <= SETTINGS
    config = IdemConfig.from_env(settings)
    assert config.resolved_ledger_path.startswith("s3://")
    command = _schedule_command()
    assert command[:2] == ["idem", "schedule"]
    assert command[command.index("--group") + 1] == config.group


def _idem_subcommands() -> set[str]:
    from idem.cli import build_cli

    return set(build_cli().commands)


@pytest.mark.unit
def test_schedule_deployment_command_is_accepted_by_the_idem_cli() -> None:
    import click

    from idem.cli import parse_args

    command = _schedule_command()
    if "schedule" not in _idem_subcommands():
        pytest.skip("`idem schedule` is not built yet")
    try:
        parse_args(command[1:])
    except click.UsageError as exc:
        pytest.fail(f"idem refuses the Deployment's command {command}: {exc.format_message()}")


def _exposed_metric_names() -> set[str]:
    from idem.metrics import COUNTERS, GAUGES, HISTOGRAMS, PREFIX

    names = {f"{PREFIX}{name}_total" for name in COUNTERS}
    names |= {f"{PREFIX}{name}" for name in GAUGES}
    parts = ("bucket", "sum", "count")
    names |= {f"{PREFIX}{name}_{part}" for name in HISTOGRAMS for part in parts}
    return names


@pytest.mark.unit
def test_grafana_dashboard_charts_only_metrics_idem_exposes_and_every_one_of_them() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "idem-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    charted = {name for expr in exprs for name in re.findall(r"\bidem_[a-z_]+", expr)}
    exposed = _exposed_metric_names()
    assert charted - exposed == set()
    # each family is on some panel (a histogram through its buckets)
    assert {n for n in exposed if not n.endswith(("_sum", "_count"))} - charted == set()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.unit
def test_schedule_deployment_probes_and_scrapes_the_port_idem_schedule_serves() -> None:
    from idem.cli import parse_args

    deployment = _k8s("Deployment", "idem-schedule-orders")
    template = deployment["spec"]["template"]
    container = template["spec"]["containers"][0]
    args = parse_args(container["command"][1:])
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
    assert args.metrics_port == port
    assert args.metrics_host == "0.0.0.0"  # noqa: S104 -- reachable by the kubelet and Prometheus
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.unit
def test_shell_scripts_parse() -> None:
    scripts = sorted(DEPLOY.rglob("*.sh"))
    assert len(scripts) >= 4
    for script in scripts:
        checked = subprocess.run(
            ["bash", "-n", str(script)], capture_output=True, text=True, check=False
        )
        assert checked.returncode == 0, f"{script}: {checked.stderr}"


@pytest.mark.integration
def test_spark_submit_script_runs_idem_run_in_the_driver() -> None:
    if shutil.which("spark-submit") is None or shutil.which("java") is None:
        pytest.skip("spark-submit (pyspark) and java are needed")
    if "run" not in _idem_subcommands():
        pytest.skip("`idem run` is not built yet")
    env = {**os.environ, "SPARK_MASTER": "local[1]", "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run(
        ["bash", str(DEPLOY / "spark" / "spark-submit.sh"), "--", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Usage: idem run" in done.stdout


@pytest.mark.integration
def test_spark_submit_settings_reach_the_session_idem_builds(tmp_path: Path) -> None:
    if shutil.which("spark-submit") is None or shutil.which("java") is None:
        pytest.skip("spark-submit (pyspark) and java are needed")
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from idem.spark.session import local_session\n"
        "s = local_session('probe')\n"
        "print('SESSION', s.sparkContext.master, s.conf.get('spark.sql.shuffle.partitions'))\n"
        "s.stop()\n"
    )
    env = {**os.environ, "SPARK_MASTER": "local[1]", "SHUFFLE_PARTITIONS": "3"}
    env |= {"APP": str(probe), "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run(
        ["bash", str(DEPLOY / "spark" / "spark-submit.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SESSION local[1] 3" in done.stdout
