"""`fleetscope alert`: deliver incidents from the anomaly and diagnosis topics to Alertmanager and webhooks."""
from __future__ import annotations

import signal

from fleetscope.cli.common import kafka_or_explain, load_config


def cmd_alert(args) -> int:
    cfg = load_config(args)
    if not kafka_or_explain(cfg, "alert"):
        return 2
    from fleetscope.streams.alerting.service import AlertService
    service = AlertService(cfg, cfg.kafka, group=args.group)
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    try:
        service.run(duration_s=args.duration)
    except KeyboardInterrupt:
        service.stop()
    return 0


def register(sub) -> None:
    p = sub.add_parser("alert", help="deliver incidents from <prefix>.anomalies and .diagnoses to Alertmanager "
                                     "and/or a webhook (alert_* settings)")
    p.add_argument("--duration", type=float, help="stop after this many seconds (default: until Ctrl-C)")
    p.add_argument("--group", help="Kafka consumer group (default: <consumer_group>-alert)")
    p.set_defaults(func=cmd_alert)
