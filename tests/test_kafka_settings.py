"""Kafka security and topology: one config section reaches every client; a bad address or login is one line.

No SASL-capable Kafka can run here, and tansu 0.6 (the embedded broker) with `--authentication` has no way to
create a first user on memory storage (see support/auth_broker.py). So a successful SASL login is not shown:
the tests check that the settings reach each client's real configuration (the librdkafka clients are real
and validate their properties; Faust's own credential translation is used for its aiokafka clients), and
a real failed SCRAM login against tansu `--authentication`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from confluent_kafka.admin import AdminClient

from fleetscope import config as config_mod
from fleetscope.broker import free_port
from fleetscope.config import Config, ConfigError
from fleetscope.kafka_settings import KafkaSecurity, KafkaUnreachable
from fleetscope.topics import all_topics, partitions_by_topic, prepare_topics
from support.auth_broker import AuthenticatingBroker

CLI = [sys.executable, "-m", "fleetscope"]
SASL_ENV = {"FLEETSCOPE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "FLEETSCOPE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
            "FLEETSCOPE_KAFKA_SASL_USERNAME": "agent-node-a", "FLEETSCOPE_KAFKA_SASL_PASSWORD": "not-the-password"}


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A real self-signed certificate and key (openssl), used as CA and client certificate."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "client.key"),
                    "-out", str(d / "client.pem"), "-days", "2", "-subj", "/CN=fleetscope-test"],
                   check=True, capture_output=True)
    return d / "client.pem", d / "client.key"


def test_toml_section_and_environment_give_one_security_setting_with_the_password_from_a_file(tmp_path):
    (tmp_path / "pw").write_text("s3cret\n")
    (tmp_path / "c.toml").write_text(
        '[kafka_security]\nsecurity_protocol = "SASL_PLAINTEXT"\nsasl_mechanism = "PLAIN"\n'
        f'sasl_username = "from-file"\nsasl_password_file = "{tmp_path / "pw"}"\n')
    cfg = config_mod.load(tmp_path / "c.toml", env={"FLEETSCOPE_KAFKA_SASL_USERNAME": "from-env"})
    sec = KafkaSecurity.from_config(cfg, env={})
    assert sec.librdkafka() == {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
                                "sasl.username": "from-env", "sasl.password": "s3cret"}
    assert "s3cret" not in repr(sec)
    # the environment variable wins over the file, for a Secret mounted as env
    assert KafkaSecurity.from_config(cfg, env={"FLEETSCOPE_KAFKA_SASL_PASSWORD": "e"}).sasl_password == "e"


@pytest.mark.parametrize("settings, says", [
    ({"kafka_security_protocol": "SASL_SSL", "kafka_sasl_username": "u"}, "sasl_mechanism"),
    ({"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "PLAIN", "kafka_sasl_username": "u"},
     "FLEETSCOPE_KAFKA_SASL_PASSWORD"),
    ({"kafka_sasl_username": "u"}, "security_protocol is PLAINTEXT"),
    ({"kafka_security_protocol": "SSL", "kafka_ssl_ca_location": "/nonexistent/ca.pem"}, "no such file"),
    ({"kafka_security_protocol": "TLS"}, "must be one of"),
    ({"kafka_ssl_ca_location": "/etc/hostname"}, "set it to SSL or SASL_SSL"),
])
def test_incomplete_or_contradictory_security_settings_are_refused_with_what_to_set(settings, says):
    with pytest.raises(ConfigError, match=says):
        KafkaSecurity.from_config(Config(**settings), env={})


def test_tls_settings_reach_librdkafka_and_an_ssl_context_for_faust(tls_files):
    cert, key = tls_files
    cfg = Config(kafka_security_protocol="SSL", kafka_ssl_ca_location=str(cert),
                 kafka_ssl_certificate_location=str(cert), kafka_ssl_key_location=str(key))
    sec = KafkaSecurity.from_config(cfg, env={})
    conf = sec.librdkafka()
    assert conf == {"security.protocol": "SSL", "ssl.ca.location": str(cert),
                    "ssl.certificate.location": str(cert), "ssl.key.location": str(key)}
    AdminClient({"bootstrap.servers": "127.0.0.1:1", **conf})  # librdkafka loads the files, or raises
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth
    auth = credentials_to_aiokafka_auth(sec.faust_settings()["broker_credentials"])
    assert auth["security_protocol"] == "SSL"
    assert auth["ssl_context"].get_ca_certs()[0]["subject"] == ((("commonName", "fleetscope-test"),),)


def test_every_librdkafka_client_is_built_with_the_security_settings(monkeypatch, tmp_path):
    """The agent's producer, the worker's output producer and the admin client: real clients, their config recorded."""
    import confluent_kafka
    from fleetscope import topics
    built: list[tuple[str, dict]] = []

    def recording(cls):
        class Recording(cls):
            def __init__(self, conf, **kw):
                built.append((cls.__name__, dict(conf)))
                super().__init__(conf, **kw)
        return Recording

    monkeypatch.setattr(confluent_kafka, "Producer", recording(confluent_kafka.Producer))
    monkeypatch.setattr(topics, "AdminClient", recording(topics.AdminClient))
    for var, value in SASL_ENV.items():
        monkeypatch.setenv(var, value)
    cfg = config_mod.load(env=os.environ, data_dir=tmp_path, kafka_connect_timeout_s=0.2)
    from fleetscope.producers.publisher import Publisher
    from fleetscope.streams.worker import derived_producer
    Publisher(cfg, "127.0.0.1:1")
    derived_producer(cfg, "127.0.0.1:1")
    with pytest.raises(KafkaUnreachable):
        prepare_topics(cfg, "127.0.0.1:1")
    assert [name for name, _ in built] == ["Producer", "Producer", "AdminClient"]
    for name, conf in built:
        assert "security.protocol" in conf, (name, sorted(conf))
        assert {k: conf[k] for k in ("security.protocol", "sasl.mechanism", "sasl.username", "sasl.password")} == {
            "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256",
            "sasl.username": "agent-node-a", "sasl.password": "not-the-password"}


def test_the_faust_app_gets_the_same_sasl_credentials(monkeypatch, tmp_path, store):
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth
    from fleetscope.streams.app import create_app
    from fleetscope.streams.processor import StreamProcessor
    for var, value in SASL_ENV.items():
        monkeypatch.setenv(var, value)
    cfg = config_mod.load(env=os.environ, data_dir=tmp_path)
    app = create_app(cfg, "127.0.0.1:1", StreamProcessor(cfg, store, producer=None))
    auth = credentials_to_aiokafka_auth(app.conf.broker_credentials, app.conf.ssl_context)
    assert auth == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
                    "sasl_plain_username": "agent-node-a", "sasl_plain_password": "not-the-password",
                    "ssl_context": None}
    assert app.conf.topic_disable_leader  # Faust creates no topic of its own (it could only ask for RF 1)


def run_cli(args, env_extra, tmp_path):
    env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(tmp_path), **env_extra}
    for var in [v for v in env if v.startswith("FLEETSCOPE_KAFKA_") and v not in env_extra]:
        env.pop(var)
    start = time.monotonic()
    # the timeout only guards against a hang; the old code printed ~290 lines and a traceback after 15 s
    done = subprocess.run(CLI + args, env=env, capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - start


@pytest.mark.integration
@pytest.mark.parametrize("command", ["agent", "streams"])
def test_a_wrong_kafka_address_is_one_line_saying_what_to_check(command, tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    done, took = run_cli([command, "--duration", "5"] if command == "agent" else [command],
                         {"FLEETSCOPE_KAFKA": address}, tmp_path)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"fleetscope: cannot reach Kafka at {address} within 5 s")
    assert "check FLEETSCOPE_KAFKA" in lines[0]
    print(f"{command}: {took:.1f} s to the error line")


@pytest.mark.integration
def test_a_refused_sasl_login_is_one_line_about_authentication(tmp_path):
    """tansu --authentication answers a real SCRAM exchange with unknown-user."""
    with AuthenticatingBroker(tmp_path / "tansu.log") as broker:
        done, took = run_cli(["agent", "--duration", "5"], {"FLEETSCOPE_KAFKA": broker.bootstrap, **SASL_ENV},
                             tmp_path)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1
    assert len(lines) == 1, lines
    assert f"Kafka at {broker.bootstrap} refused authentication" in lines[0]
    assert "unknown-user" in lines[0] and "FLEETSCOPE_KAFKA_SASL_USERNAME" in lines[0]
    print(f"refused login: {took:.1f} s to the error line")


def test_partitions_per_topic_override_the_default_and_unknown_names_are_refused():
    cfg = Config(topic_prefix="p", partitions=4, topic_partitions=("features=8", "raw.nvml=12"))
    counts = partitions_by_topic(cfg)
    assert counts["p.features"] == 8 and counts["p.raw.nvml"] == 12 and counts["p.scores"] == 4
    assert set(counts) == set(all_topics(cfg))
    with pytest.raises(ConfigError, match="NAME one of"):
        partitions_by_topic(Config(topic_partitions=("featurez=8",)))
    assert Config().topic_replication == -1  # the broker's default, not 1
    with pytest.raises(ConfigError, match="topic_replication"):
        Config(topic_replication=0).validate()


@pytest.mark.integration
def test_topics_are_created_with_their_partition_counts_and_not_at_all_when_managed(broker):
    prefix = f"topo{time.time_ns()}"
    managed = Config(topic_prefix=prefix, create_topics=False, kafka_connect_timeout_s=10)
    with pytest.raises(KafkaUnreachable, match=f"topics missing on Kafka at .*{prefix}.raw.host"):
        prepare_topics(managed, broker.bootstrap)
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    assert not [t for t in admin.list_topics(timeout=10).topics if t.startswith(prefix)]

    cfg = Config(topic_prefix=prefix, partitions=2, topic_partitions=("anomalies=3",), kafka_connect_timeout_s=10)
    assert sorted(prepare_topics(cfg, broker.bootstrap)) == sorted(all_topics(cfg))
    topics = admin.list_topics(timeout=10).topics
    assert len(topics[f"{prefix}.anomalies"].partitions) == 3
    assert len(topics[f"{prefix}.features"].partitions) == 2
    assert prepare_topics(managed, broker.bootstrap) == []  # all there now: the managed check passes


def test_the_delivery_timeout_of_worker_and_sink_outputs_comes_from_the_config(monkeypatch, tmp_path):
    """kafka_delivery_timeout_s reaches librdkafka's message.timeout.ms of both output producers (the worker's
    whole effect is tested end to end in test_worker_fatal_exit); out-of-range values are refused."""
    from fleetscope.kafka_settings import output_producer_conf
    monkeypatch.setenv("FLEETSCOPE_KAFKA_DELIVERY_TIMEOUT_S", "42.5")
    cfg = config_mod.load(env=os.environ, data_dir=tmp_path)
    assert cfg.kafka_delivery_timeout_s == 42.5
    for client in ("fleetscope-streams", "fleetscope-sink"):
        conf = output_producer_conf(cfg, "127.0.0.1:1", client)
        assert conf["message.timeout.ms"] == 42_500 and conf["client.id"] == client
        assert conf["acks"] == "all" and conf["enable.idempotence"] is True
    assert Config(data_dir=tmp_path).kafka_delivery_timeout_s == 300.0  # librdkafka's own default
    for bad in (0.5, 0, -1, 100_000):
        with pytest.raises(ConfigError, match="kafka_delivery_timeout_s"):
            Config(data_dir=tmp_path, kafka_delivery_timeout_s=bad).validate()
