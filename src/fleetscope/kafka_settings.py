"""Kafka client settings from one place, for every client fleetscope opens.

The agent's producer, the stream worker's output producer and the admin client
are librdkafka (confluent-kafka); the Faust consumer and producer are aiokafka.
All of them take the same security section of the config, so a SASL/TLS
cluster is configured once. The SASL password is a secret: it comes from
FLEETSCOPE_KAFKA_SASL_PASSWORD or a file (a mounted Secret), never the config.

It also turns a failed first contact with Kafka into one line that says what
to check, instead of librdkafka's stream of retries and a traceback.
"""
from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from fleetscope.broker import BrokerError
from fleetscope.config import Config, ConfigError

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
# What both librdkafka and aiokafka speak (GSSAPI and OAUTHBEARER need per-site callbacks: not offered).
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
PASSWORD_ENV = "FLEETSCOPE_KAFKA_SASL_PASSWORD"


class KafkaUnreachable(BrokerError):
    """Kafka did not answer, or refused us, at start; the message is the one line a user sees."""


@dataclass(frozen=True)
class KafkaSecurity:
    protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)  # never printed
    ssl_ca_location: str | None = None
    ssl_certificate_location: str | None = None
    ssl_key_location: str | None = None

    @property
    def uses_sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def uses_tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    @classmethod
    def from_config(cls, cfg: Config, env: dict | None = None) -> "KafkaSecurity":
        """The checked security settings of `cfg`, with the password read from the environment or its file."""
        env = os.environ if env is None else env
        protocol = (cfg.kafka_security_protocol or "PLAINTEXT").upper()
        if protocol not in SECURITY_PROTOCOLS:
            raise ConfigError(f"kafka_security.security_protocol={protocol!r}: must be one of {list(SECURITY_PROTOCOLS)}")
        sec = cls(protocol=protocol,
                  sasl_mechanism=cfg.kafka_sasl_mechanism.upper() if cfg.kafka_sasl_mechanism else None,
                  sasl_username=cfg.kafka_sasl_username, sasl_password=_password(cfg, env),
                  ssl_ca_location=cfg.kafka_ssl_ca_location,
                  ssl_certificate_location=cfg.kafka_ssl_certificate_location,
                  ssl_key_location=cfg.kafka_ssl_key_location)
        sec._check()
        return sec

    def _check(self) -> None:
        if self.uses_sasl:
            if self.sasl_mechanism not in SASL_MECHANISMS:
                raise ConfigError(f"security_protocol {self.protocol} needs kafka_security.sasl_mechanism, one of "
                                  f"{list(SASL_MECHANISMS)} (got {self.sasl_mechanism!r})")
            if not self.sasl_username or self.sasl_password is None:
                raise ConfigError(f"security_protocol {self.protocol} needs FLEETSCOPE_KAFKA_SASL_USERNAME and the "
                                  f"password in {PASSWORD_ENV} or the file FLEETSCOPE_KAFKA_SASL_PASSWORD_FILE")
        elif self.sasl_mechanism or self.sasl_username:
            raise ConfigError(f"SASL settings are given but security_protocol is {self.protocol}: "
                              "set it to SASL_SSL (or SASL_PLAINTEXT), or drop the SASL settings")
        tls_files = {"ssl_ca_location": self.ssl_ca_location, "ssl_certificate_location": self.ssl_certificate_location,
                     "ssl_key_location": self.ssl_key_location}
        given = {k: v for k, v in tls_files.items() if v}
        if given and not self.uses_tls:
            raise ConfigError(f"{', '.join(given)} given but security_protocol is {self.protocol}: "
                              "set it to SSL or SASL_SSL")
        for name, path in given.items():
            if not Path(path).is_file():
                raise ConfigError(f"kafka_security.{name}={path}: no such file")
        if bool(self.ssl_certificate_location) != bool(self.ssl_key_location):
            raise ConfigError("a TLS client certificate needs both ssl_certificate_location and ssl_key_location")

    def librdkafka(self) -> dict:
        """The librdkafka (confluent-kafka) properties: add them to any Producer, Consumer or AdminClient config."""
        conf = {"security.protocol": self.protocol}
        if self.uses_sasl:
            conf.update({"sasl.mechanism": self.sasl_mechanism, "sasl.username": self.sasl_username,
                         "sasl.password": self.sasl_password})
        for key, value in (("ssl.ca.location", self.ssl_ca_location),
                           ("ssl.certificate.location", self.ssl_certificate_location),
                           ("ssl.key.location", self.ssl_key_location)):
            if value:
                conf[key] = value
        return conf

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context aiokafka needs (it takes no file paths): the CA, or the system's, and the client cert."""
        if not self.uses_tls:
            return None
        context = ssl.create_default_context(cafile=self.ssl_ca_location)
        if self.ssl_certificate_location:
            context.load_cert_chain(self.ssl_certificate_location, self.ssl_key_location)
        return context

    def faust_settings(self) -> dict:
        """Faust app settings carrying the same security (its consumer and producer are aiokafka)."""
        from faust.auth import SASLCredentials, SSLCredentials
        if self.uses_sasl:
            return {"broker_credentials": SASLCredentials(
                username=self.sasl_username, password=self.sasl_password,
                mechanism=self.sasl_mechanism, ssl_context=self.ssl_context())}
        if self.uses_tls:
            return {"broker_credentials": SSLCredentials(self.ssl_context())}
        return {}


def _password(cfg: Config, env) -> str | None:
    if PASSWORD_ENV in env:
        return env[PASSWORD_ENV]
    if cfg.kafka_sasl_password_file:
        try:
            return Path(cfg.kafka_sasl_password_file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"kafka_security.sasl_password_file {cfg.kafka_sasl_password_file}: "
                              f"{exc.strerror}") from None
    return None


def client_conf(cfg: Config, bootstrap: str, **extra) -> dict:
    """A librdkafka config for `bootstrap` with the configured security, plus `extra`."""
    return {"bootstrap.servers": bootstrap, **KafkaSecurity.from_config(cfg).librdkafka(), **extra}


def output_producer_conf(cfg: Config, bootstrap: str, client_id: str, **extra) -> dict:
    """An idempotent acks=all producer for a stream worker's or a sink's outputs; a message Kafka has not
    acknowledged within kafka_delivery_timeout_s fails, and with it the process (to be restarted)."""
    return client_conf(cfg, bootstrap, **{"acks": "all", "enable.idempotence": True, "client.id": client_id,
                                          "message.timeout.ms": int(cfg.kafka_delivery_timeout_s * 1000), **extra})


# librdkafka error names that mean "we reached a broker and it refused us", as opposed to "no broker answered"
_AUTH_ERRORS = {"_AUTHENTICATION", "SASL_AUTHENTICATION_FAILED", "TOPIC_AUTHORIZATION_FAILED",
                "CLUSTER_AUTHORIZATION_FAILED", "UNSUPPORTED_SASL_MECHANISM", "ILLEGAL_SASL_STATE"}
_TLS_ERRORS = {"_SSL"}


def release_producer(producer) -> None:
    """Purge a producer that is being thrown away and serve the purged messages' delivery reports. Each report
    holds its callback, and a callback its owner (the agent's Publisher, the worker's StreamProcessor), which holds
    the producer: a cycle through librdkafka that Python's collector cannot see. Unserved, it kept every replaced
    or closed producer alive, its threads reconnecting to the broker for as long as the process ran. (The
    callbacks see a taken-back message and do nothing.)"""
    try:
        producer.purge(in_queue=True, in_flight=True, blocking=False)
        producer.flush(1.0)
    except Exception:  # noqa: BLE001 - the producer is being thrown away whatever it says
        pass


def is_fatal_at_start(error_name: str) -> bool:
    """A refusal that waiting will not cure: report it at once instead of retrying to the deadline."""
    return error_name in _AUTH_ERRORS or error_name in _TLS_ERRORS


def explain_failure(cfg: Config, bootstrap: str, error_name: str | None, detail: str, waited_s: float) -> str:
    """One line: what happened at first contact and what to check."""
    protocol = cfg.kafka_security_protocol
    if error_name in _AUTH_ERRORS:
        return (f"Kafka at {bootstrap} refused authentication ({detail}): check FLEETSCOPE_KAFKA_SASL_USERNAME, "
                f"the password ({PASSWORD_ENV} or FLEETSCOPE_KAFKA_SASL_PASSWORD_FILE), sasl_mechanism "
                f"({cfg.kafka_sasl_mechanism}) and this user's ACLs (README: Deploy, Kafka ACLs)")
    if error_name in _TLS_ERRORS:
        return (f"TLS with Kafka at {bootstrap} failed ({detail}): check ssl_ca_location, the client certificate "
                f"and key, and that security_protocol ({protocol}) matches the broker's listener")
    return (f"cannot reach Kafka at {bootstrap} within {waited_s:g} s ({detail}): check FLEETSCOPE_KAFKA "
            f"(a broker's host:port), that the broker runs and this host can reach it, and that "
            f"security_protocol ({protocol}) matches its listener")
