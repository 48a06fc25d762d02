"""Per-tenant routing: labels added to a tenant's alerts, and the webhook its incidents go to."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from fleetscope.config import ConfigError

LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # Alertmanager (Prometheus) label names


@dataclass(frozen=True)
class Routing:
    alertmanager_url: str | None
    webhook_url: str | None
    tenant_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    tenant_webhooks: dict[str, str] = field(default_factory=dict)

    def labels(self, tenant: str) -> dict[str, str]:
        return self.tenant_labels.get(tenant, {})

    def webhook(self, tenant: str) -> str | None:
        return self.tenant_webhooks.get(tenant, self.webhook_url)

    @classmethod
    def from_config(cls, cfg) -> "Routing":
        labels: dict[str, dict[str, str]] = {}
        for item in cfg.alert_tenant_labels:
            tenant, sep, pair = item.partition(":")
            name, eq, value = pair.partition("=")
            if not sep or not eq or not tenant or not LABEL_NAME.match(name):
                raise ConfigError(f"alert_tenant_labels entry {item!r}: write tenant:label=value "
                                  f"(label names match {LABEL_NAME.pattern})")
            labels.setdefault(tenant, {})[name] = value
        hooks: dict[str, str] = {}
        for item in cfg.alert_tenant_webhooks:
            tenant, eq, url = item.partition("=")
            if not eq or not tenant or not url.startswith(("http://", "https://")):
                raise ConfigError(f"alert_tenant_webhooks entry {item!r}: write tenant=http(s)://url")
            hooks[tenant] = url
        routing = cls(cfg.alert_alertmanager_url, cfg.alert_webhook_url, labels, hooks)
        if not routing.alertmanager_url and not routing.webhook_url and not hooks:
            raise ConfigError("fleetscope alert has nowhere to deliver: set alert_alertmanager_url and/or "
                              "alert_webhook_url (FLEETSCOPE_ALERT_ALERTMANAGER_URL, FLEETSCOPE_ALERT_WEBHOOK_URL)")
        return routing
