"""The fleet's deployment: deploy/kubernetes/ and docs/fleet.md, checked as far as a
machine without a cluster can.

The manifests are read with PyYAML where it is installed, and otherwise with
`load_yaml`, a reader of the part of YAML they are written in (it refuses the
rest); where PyYAML is installed the two must agree. What is checked: the
ConfigMap's config is one the daemon accepts; the DaemonSet shares the node's pids
and socket directory, with exactly the capabilities the page gives reasons for;
the config's TLS files are the Secret's, mounted; a worker reaches the daemon's
socket; the Dockerfile installs the wheels `make wheels` builds; and the manifests
follow Kubernetes' schemas, where kubernetes-validate is installed, and ``kubectl
apply --dry-run=client`` takes them, where kubectl has an API server. From the
page: its TOML is config the daemon accepts, its systemd drop-in verifies with
systemd's own tools, its etcd settings are etcd's flags, its certificate recipes
(openssl, cfssl) make an etcd the daemon's client can use, and every link to it
and from it resolves.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from _pytest.mark.structures import ParameterSet

from watchdogd.core.config import Config, parse_config
from watchdogd.fleet.etcd import EtcdClient
from watchdogd.fleet.gateway import EtcdUnavailable

from helpers.etcd import TlsFiles, etcd_binary, running_etcd
from helpers.pages import anchors, fenced, fenced_with, links

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
DAEMONSET = KUBERNETES / "watchdogd-daemonset.yaml"
WORKER = KUBERNETES / "worker-example.yaml"
PODMONITOR = KUBERNETES / "podmonitor.yaml"
PAGE = ROOT / "docs" / "fleet.md"
#: The oldest Kubernetes the manifests are written for.
KUBERNETES_VERSION = "1.27.0"
#: Pages that may link to the fleet's page.
PAGES = [ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "client" / "README.md"]
INSTALLED = "/usr/local/bin/watchdogd"
WATCHDOGD = str(Path(sys.executable).parent / "watchdogd")


# The manifests.


def load_yaml(text: str) -> list[Any]:
    """The documents of ``text``, read as YAML 1.1 reads them, for the part of YAML
    these manifests use: block mappings and sequences, plain and quoted scalars,
    flow sequences of scalars, literal blocks (``|``, ``|-``) and comments. Raises
    ValueError on anything else (anchors, tags, flow mappings, folded blocks)."""
    chunks: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.rstrip() == "---":
            chunks.append([])
        else:
            chunks[-1].append(line)
    if not any(_content(line) for line in chunks[0]):
        chunks = chunks[1:]  # comments before the first "---" are no document
    return [_Reader(chunk).document() for chunk in chunks]


def _content(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


class _Reader:
    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.at = 0

    def document(self) -> Any:
        line = self._next()
        if line is None:
            return None
        value = self._node(line[0])
        if self._next() is not None:
            raise ValueError(f"unexpected line: {self.lines[self.at]!r}")
        return value

    def _next(self) -> tuple[int, str] | None:
        """The next line with content, as (indent, text); None at the end."""
        while self.at < len(self.lines) and not _content(self.lines[self.at]):
            self.at += 1
        if self.at == len(self.lines):
            return None
        line = self.lines[self.at]
        if "\t" in line[: len(line) - len(line.lstrip())]:
            raise ValueError(f"a tab in an indent: {line!r}")
        return len(line) - len(line.lstrip(" ")), line.strip()

    def _node(self, indent: int) -> Any:
        line = self._next()
        assert line is not None
        if line[1] == "-" or line[1].startswith("- "):
            return self._sequence(indent)
        return self._mapping(indent)

    def _mapping(self, indent: int) -> dict[Any, Any]:
        mapping: dict[Any, Any] = {}
        while (line := self._next()) is not None and line[0] == indent:
            text = line[1]
            if text == "-" or text.startswith("- "):
                break
            match = re.fullmatch(r"(\"[^\"]*\"|'[^']*'|[^\s\"'#][^:#]*?)\s*:(?:\s+(.*))?", text)
            if match is None:
                raise ValueError(f"not a key: {text!r}")
            key = _scalar(match.group(1))
            if key in mapping:
                raise ValueError(f"a key twice: {key!r}")
            self.at += 1
            mapping[key] = self._value(match.group(2) or "", indent)
        if line is not None and line[0] > indent:
            raise ValueError(f"unexpected indent: {self.lines[self.at]!r}")
        return mapping

    def _sequence(self, indent: int) -> list[Any]:
        sequence: list[Any] = []
        while (line := self._next()) is not None and line[0] == indent:
            text = line[1]
            if not (text == "-" or text.startswith("- ")):
                break
            rest = text[1:].lstrip(" ")
            if not rest or rest.startswith("#"):
                self.at += 1
                nested = self._next()
                if nested is None or nested[0] <= indent:
                    sequence.append(None)
                else:
                    sequence.append(self._node(nested[0]))
            elif re.match(r"(\"[^\"]*\"|'[^']*'|[^\s\"'#\[][^:#]*?)\s*:(\s|$)", rest):
                # "- key: value": a mapping whose keys line up with this one's.
                column = indent + len(text) - len(rest)
                self.lines[self.at] = " " * column + rest
                sequence.append(self._mapping(column))
            else:
                self.at += 1
                sequence.append(self._value(rest, indent))
        return sequence

    def _value(self, text: str, indent: int) -> Any:
        """The value after a key (or a "- ") on a line of ``indent``."""
        if text.startswith("|"):
            return self._literal(text, indent)
        if text and not text.startswith("#"):
            return _scalar(text)
        line = self._next()
        if line is None or line[0] < indent:
            return None
        if line[0] == indent:  # "key:" then "- item" at the key's indent
            return self._sequence(indent) if line[1].startswith("-") else None
        return self._node(line[0])

    def _literal(self, header: str, indent: int) -> str:
        if header.split("#", 1)[0].strip() not in ("|", "|-"):
            raise ValueError(f"a block style this reader does not know: {header!r}")
        body: list[str] = []
        while self.at < len(self.lines):
            line = self.lines[self.at]
            if line.strip() and len(line) - len(line.lstrip(" ")) <= indent:
                break
            body.append(line)
            self.at += 1
        while body and not body[-1].strip():
            body.pop()
        if not body:
            return ""
        margin = min(len(line) - len(line.lstrip(" ")) for line in body if line.strip())
        text = "\n".join(line[margin:] for line in body)
        return text if header.startswith("|-") else text + "\n"


def _scalar(text: str) -> Any:
    text = text.strip()
    if text.startswith('"'):
        match = re.match(r'"((?:[^"\\]|\\.)*)"\s*(#.*)?$', text)
        if match is None:
            raise ValueError(f"a double-quoted scalar this reader does not know: {text!r}")
        escapes = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "/": "/"}
        return re.sub(r"\\(.)", lambda m: escapes[m.group(1)], match.group(1))
    if text.startswith("'"):
        match = re.match(r"'((?:[^']|'')*)'\s*(#.*)?$", text)
        if match is None:
            raise ValueError(f"a single-quoted scalar this reader does not know: {text!r}")
        return match.group(1).replace("''", "'")
    if text.startswith("["):
        inner = re.match(r"\[(.*)\]\s*(#.*)?$", text)
        if inner is None:
            raise ValueError(f"a flow sequence this reader does not know: {text!r}")
        items = re.findall(
            r"\s*(\"(?:[^\"\\]|\\.)*\"|'(?:[^']|'')*'|[^,\[\]{}]+)\s*(?:,|$)", inner.group(1)
        )
        return [_scalar(item) for item in items]
    if text.startswith(("{", "&", "*", "!", ">", "%", "@", "`")):
        raise ValueError(f"a scalar this reader does not know: {text!r}")
    plain = re.split(r"\s+#", text, maxsplit=1)[0].strip()
    return _resolve(plain)


def _resolve(plain: str) -> Any:
    """A plain scalar's value under YAML 1.1's rules, as Kubernetes and PyYAML read it."""
    if plain in ("", "~", "null", "Null", "NULL"):
        return None
    if plain in ("true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"):
        return True
    if plain in ("false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"):
        return False
    if re.fullmatch(r"[-+]?0[0-7]+", plain):
        return int(plain, 8)
    if re.fullmatch(r"[-+]?(0|[1-9][0-9_]*)", plain):
        return int(plain.replace("_", ""))
    if re.fullmatch(r"[-+]?0x[0-9a-fA-F]+", plain):
        return int(plain, 16)
    if re.fullmatch(r"[-+]?([0-9][0-9_]*)?\.[0-9_]*([eE][-+][0-9]+)?", plain) and plain != ".":
        return float(plain.replace("_", ""))
    return plain


def manifests(path: Path) -> list[Any]:
    """The documents of ``path``: PyYAML's reading where it is installed."""
    text = path.read_text()
    try:  # optional: never a dependency of the suite
        yaml = importlib.import_module("yaml")
    except ModuleNotFoundError:
        return load_yaml(text)
    return list(yaml.safe_load_all(text))


def of_kind(documents: list[Any], kind: str) -> Any:
    (found,) = [document for document in documents if document["kind"] == kind]
    return found


@pytest.fixture(scope="module")
def deployed() -> list[Any]:
    return manifests(DAEMONSET)


@pytest.fixture(scope="module")
def daemon_pod(deployed: list[Any]) -> Any:
    return of_kind(deployed, "DaemonSet")["spec"]["template"]["spec"]


def container_of(pod: Any) -> Any:
    (container,) = pod["containers"]
    return container


def mount_of(pod: Any, path: str) -> tuple[Any, Any]:
    """The volume mounted at ``path`` in the pod's container, and its mount."""
    (mount,) = [m for m in container_of(pod)["volumeMounts"] if m["mountPath"] == path]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume, mount


def env_of(container: Any) -> dict[str, Any]:
    return {variable["name"]: variable for variable in container["env"]}


def config_of(deployed: list[Any]) -> Config:
    config_map = of_kind(deployed, "ConfigMap")
    return parse_config(config_map["data"]["watchdogd.toml"], f"{DAEMONSET.name}: ConfigMap")


@pytest.mark.parametrize("path", [DAEMONSET, WORKER, PODMONITOR], ids=lambda path: path.name)
def test_the_yaml_reader_reads_as_pyyaml_does(path: Path) -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed to compare with")
    assert load_yaml(path.read_text()) == list(yaml.safe_load_all(path.read_text()))


def test_the_yaml_reader_refuses_what_it_does_not_know() -> None:
    for text in ("a: &x 1", "a: {b: 1}", "a: >\n  folded", "a: !!str 1", "a:\n\tb: 1"):
        with pytest.raises(ValueError, match=r"this reader does not know|a tab in an indent"):
            load_yaml(text)
    assert load_yaml("# one\n---\na:\n- 0400\n- '0400'\n- [x, \"y\"]\nb: |\n  line\n\n") == [
        {"a": [256, "0400", ["x", "y"]], "b": "line\n"}
    ]


def test_one_namespace_holds_the_config_and_the_daemonset(deployed: list[Any]) -> None:
    assert [document["kind"] for document in deployed] == ["Namespace", "ConfigMap", "DaemonSet"]
    namespace = of_kind(deployed, "Namespace")["metadata"]
    assert {document["metadata"].get("namespace") for document in deployed[1:]} == {
        namespace["name"]
    }
    # Host namespaces, host paths and SYS_PTRACE are all outside "baseline".
    assert namespace["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_the_configmaps_config_is_one_the_daemon_accepts(deployed: list[Any]) -> None:
    fleet = config_of(deployed).fleet
    assert fleet.etcd
    assert all(url.startswith("https://") for url in fleet.etcd)
    assert None not in (fleet.ca, fleet.cert, fleet.key)
    assert fleet.host is None, "each daemon must take its node's name"


def test_the_daemon_shares_the_nodes_pids_and_host_name(daemon_pod: Any) -> None:
    assert daemon_pod["hostPID"] is True
    assert daemon_pod["hostNetwork"] is True
    assert daemon_pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert daemon_pod["automountServiceAccountToken"] is False
    assert {"operator": "Exists"} in daemon_pod["tolerations"]


def test_the_daemon_has_two_capabilities_and_nothing_else(daemon_pod: Any) -> None:
    context = container_of(daemon_pod)["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["KILL", "SYS_PTRACE"]}
    assert context["privileged"] is False
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    # Added capabilities are in effect for uid 0 alone.
    assert context["runAsUser"] == 0
    assert daemon_pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_the_socket_is_in_the_nodes_directory(daemon_pod: Any) -> None:
    container = container_of(daemon_pod)
    volume, mount = mount_of(daemon_pod, "/run/watchdogd")
    assert volume["hostPath"] == {"path": "/run/watchdogd", "type": "DirectoryOrCreate"}
    assert not mount.get("readOnly")
    socket = env_of(container)["WATCHDOGD_SOCKET"]["value"]
    assert Path(socket).parent == Path(mount["mountPath"])
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == ["watchdogctl", "ping"]


def test_the_daemon_reads_the_configmap_and_the_secret(
    deployed: list[Any], daemon_pod: Any
) -> None:
    command = container_of(daemon_pod)["command"]
    assert command[:2] == ["watchdogd", "--config"]
    config_path = Path(command[2])
    volume, mount = mount_of(daemon_pod, str(config_path.parent))
    assert volume["configMap"]["name"] == of_kind(deployed, "ConfigMap")["metadata"]["name"]
    assert config_path.name in of_kind(deployed, "ConfigMap")["data"]
    assert mount["readOnly"] is True

    fleet = config_of(deployed).fleet
    files = [Path(path) for path in (fleet.ca, fleet.cert, fleet.key) if path is not None]
    (directory,) = {path.parent for path in files}
    volume, mount = mount_of(daemon_pod, str(directory))
    secret = volume["secret"]
    assert sorted(item["path"] for item in secret["items"]) == sorted(p.name for p in files)
    assert secret["defaultMode"] == 0o400
    assert mount["readOnly"] is True


def test_the_daemon_serves_its_metrics_where_the_podmonitor_scrapes(
    deployed: list[Any], daemon_pod: Any
) -> None:
    container = container_of(daemon_pod)
    command = container["command"]
    address = command[command.index("--metrics-listen") + 1]
    assert address == "$(POD_IP):9101"
    assert env_of(container)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    [port] = [port for port in container["ports"] if port["name"] == "metrics"]
    assert port["containerPort"] == int(address.rsplit(":", 1)[1])
    assert "--metrics-jobs" not in command  # the page names no job
    # What the manifest and the page say of the node's network is so: one port.
    assert f"its metrics' ({port['containerPort']} on the node's address" in DAEMONSET.read_text()
    assert "opens no port" not in DAEMONSET.read_text() + PAGE.read_text()
    monitor = of_kind(manifests(PODMONITOR), "PodMonitor")
    daemonset = of_kind(deployed, "DaemonSet")
    assert monitor["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")


def test_a_worker_reaches_the_daemons_socket(daemon_pod: Any) -> None:
    (job,) = manifests(WORKER)
    worker = job["spec"]["template"]["spec"]
    daemon_volume, _ = mount_of(daemon_pod, "/run/watchdogd")
    volume, mount = mount_of(worker, "/run/watchdogd")
    assert volume["hostPath"]["path"] == daemon_volume["hostPath"]["path"]
    assert mount["readOnly"] is True
    env = env_of(container_of(worker))
    daemon_env = env_of(container_of(daemon_pod))
    assert env["WATCHDOGD_SOCKET"]["value"] == daemon_env["WATCHDOGD_SOCKET"]["value"]
    # The job's name: the downward API's namespace and Job label, joined.
    named = re.findall(r"\$\((\w+)\)", env["WATCHDOGD_JOB"]["value"])
    fields = [env[name]["valueFrom"]["fieldRef"]["fieldPath"] for name in named]
    assert fields == ["metadata.namespace", "metadata.labels['batch.kubernetes.io/job-name']"]
    assert "fieldRef" in env["WATCHDOGD_RANK"]["valueFrom"]
    # One uid for every pod of the job, set in its template.
    assert isinstance(worker["securityContext"]["runAsUser"], int)


def test_the_image_installs_the_wheels_make_builds(daemon_pod: Any) -> None:
    dockerfile = (KUBERNETES / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    match = re.search(r"^ARG VERSION=(\S+)$", dockerfile, re.M)
    assert match is not None
    for project in (ROOT / "pyproject.toml", ROOT / "client" / "pyproject.toml"):
        meta = tomllib.loads(project.read_text())["project"]
        assert meta["version"] == match.group(1)
        wheel = f"{meta['name'].replace('-', '_')}-${{VERSION}}-py3-none-any.whl"
        assert re.search(rf"^COPY .*{re.escape(wheel)}", dockerfile, re.M), wheel
    assert re.search(r"^RUN pip install .*/wheels/\*\.whl .*py-spy", dockerfile, re.M)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    container = container_of(daemon_pod)
    assert container["command"][0] in scripts
    assert container["livenessProbe"]["exec"]["command"][0] in scripts


@pytest.mark.parametrize("path", [DAEMONSET, WORKER], ids=lambda path: path.name)
def test_the_manifests_follow_kubernetes_schemas(path: Path) -> None:
    schemas = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed to check with"
    )
    for document in manifests(path):
        # Strict: a field Kubernetes does not know is an error, not ignored.
        schemas.validate(document, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", [DAEMONSET, WORKER], ids=lambda path: path.name)
def test_kubectl_takes_the_manifests(path: Path) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(
        ["kubectl", "apply", "--dry-run=client", "--request-timeout=10s", "-f", str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    unreachable = (
        "connection refused",
        "couldn't get current server API group list",
        "failed to download openapi",
        "Unable to connect to the server",
        "no configuration has been provided",
    )
    if result.returncode != 0 and any(words in result.stderr for words in unreachable):
        # A client dry run still asks the API server for its kinds and schemas.
        pytest.skip(f"kubectl has no API server to check against: {result.stderr.strip()[:200]}")
    assert result.returncode == 0, result.stderr


# The page.


def test_the_pages_configs_are_ones_the_daemon_accepts() -> None:
    blocks = list(fenced(PAGE, "toml"))
    assert len(blocks) >= 2
    for number, block in enumerate(blocks, 1):
        assert parse_config(block, f"{PAGE.name}, toml block {number}").fleet.etcd


def test_the_pages_etcd_settings_are_etcds_flags() -> None:
    settings = fenced_with(PAGE, "sh", "ETCD_NAME=")
    result = subprocess.run(
        [etcd_binary(), "--help"], capture_output=True, text=True, check=False, timeout=60
    )
    flags = set(re.findall(r"^\s+(--[a-z0-9-]+)", result.stdout + result.stderr, re.M))
    names = [line.split("=", 1)[0] for line in settings.splitlines() if _content(line)]
    assert names
    assert all(name.startswith("ETCD_") for name in names)
    unknown = [
        n for n in names if "--" + n.removeprefix("ETCD_").lower().replace("_", "-") not in flags
    ]
    assert not unknown


needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd's tools are not installed"
)


@needs_systemd_analyze
def test_the_pages_drop_in_verifies_and_opens_just_what_the_fleet_needs(tmp_path: Path) -> None:
    for unit in ("watchdogd.service", "watchdogd.socket"):
        text = (ROOT / "systemd" / unit).read_text()
        (tmp_path / unit).write_text(text.replace(INSTALLED, WATCHDOGD))
    drop_in = fenced_with(PAGE, "ini", "LoadCredential=")
    (tmp_path / "watchdogd.service.d").mkdir()
    (tmp_path / "watchdogd.service.d" / "fleet.conf").write_text(
        drop_in.replace(INSTALLED, WATCHDOGD)
    )
    units = [str(tmp_path / "watchdogd.socket"), str(tmp_path / "watchdogd.service")]
    verify = subprocess.run(
        ["systemd-analyze", "verify", *units], capture_output=True, text=True, check=False
    )
    assert verify.returncode == 0, verify.stderr
    assert verify.stderr == ""
    security = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", units[1]],
        capture_output=True,
        text=True,
        check=False,
    )
    match = re.search(r"Overall exposure level for watchdogd.service: ([0-9.]+)", security.stdout)
    assert match, security.stdout + security.stderr
    assert float(match.group(1)) <= 2.0

    settings = [
        line.split("=", 1) for line in drop_in.splitlines() if _content(line) and "=" in line
    ]
    assert ["PrivateNetwork", "no"] in settings
    (families,) = [value for key, value in settings if key == "RestrictAddressFamilies"]
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families.split())
    # The addresses allowed are the members', and the files handed over the config's.
    fleet = parse_config(fenced_with(PAGE, "toml", "/run/credentials/"), "drop-in's").fleet
    (allowed,) = [value for key, value in settings if key == "IPAddressAllow"]
    assert set(allowed.split()) == {urlsplit(url).hostname for url in fleet.etcd}
    credentials = dict(value.split(":", 1) for key, value in settings if key == "LoadCredential")
    for path in (fleet.ca, fleet.cert, fleet.key):
        assert path is not None
        assert Path(path).parent == Path("/run/credentials/watchdogd.service")
        assert Path(path).name in credentials


class _PageFiles(TlsFiles):
    """What the page's certificate commands made in ``directory``: the CA, the first
    member's certificate, and the client's."""

    def __init__(self, directory: Path) -> None:  # made by the page, not by TlsFiles
        self.ca = directory / "ca.pem"
        self.ca_key = directory / "ca-key.pem"
        self.server_cert = directory / "etcd1.pem"
        self.server_key = directory / "etcd1-key.pem"
        self.client_cert = directory / "client.pem"
        self.client_key = directory / "client-key.pem"


def _with_tools(words: str, *tools: str) -> ParameterSet:
    """The recipe that begins with ``words``, skipped (with why) where ``tools`` are
    missing: decided before the test runs, since a skip raised inside trio's run
    loses its reason."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    reason = f"no {' '.join(missing)} command here"
    return pytest.param(words, id=tools[0], marks=pytest.mark.skipif(bool(missing), reason=reason))


@pytest.mark.parametrize(
    "words",
    [_with_tools("openssl req -x509", "openssl"),
     _with_tools("cfssl gencert -initca", "cfssl", "cfssljson")],
)  # fmt: skip
async def test_the_pages_certificates_make_an_etcd_the_daemon_can_use(
    words: str, tmp_path: Path
) -> None:
    # The first member, here on the loopback address.
    script = fenced_with(PAGE, "sh", words).replace("10.0.0.5", "127.0.0.1")
    made = subprocess.run(
        ["bash", "-euc", script], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert made.returncode == 0, made.stderr
    files = _PageFiles(tmp_path)
    with running_etcd(tmp_path / "etcd", tls=files) as etcd:
        async with EtcdClient(
            [etcd.url], ca=str(files.ca), cert=str(files.client_cert), key=str(files.client_key)
        ) as client:
            await client.put("/watchdogd/hosts/gpu7", b"{}")
            assert [kv.key for kv in (await client.range("/watchdogd/")).kvs] == [
                b"/watchdogd/hosts/gpu7"
            ]
        # Without a certificate of the fleet's CA, no connection at all.
        async with EtcdClient([etcd.url], ca=str(files.ca)) as stranger:
            with pytest.raises(EtcdUnavailable, match="bad certificate"):
                await stranger.range("/watchdogd/")


def test_every_link_to_the_fleet_page_resolves() -> None:
    sources = [*PAGES, *sorted((ROOT / "docs").glob("*.md"))]
    found = [
        (source, anchor) for source in sources for file, anchor in links(source) if file == PAGE
    ]
    assert any(source == ROOT / "README.md" for source, _ in found)
    for source, anchor in found:
        assert not anchor or anchor in anchors(PAGE), f"{source.name}: #{anchor}"


def test_every_link_of_the_fleet_page_resolves() -> None:
    targets = list(links(PAGE))
    assert any(file.is_relative_to(KUBERNETES) for file, _ in targets)
    for file, anchor in targets:
        assert file.exists(), file
        if anchor:
            assert file.suffix == ".md"
            assert anchor in anchors(file), f"{file.name}#{anchor}"
