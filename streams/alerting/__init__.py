"""Alert delivery: incidents from `<prefix>.anomalies` and `<prefix>.diagnoses` to Alertmanager and webhooks.

incidents.py groups flagged windows into incidents (a job and its culprit), routing.py says which labels and
webhook a tenant's incidents get, alertmanager.py and webhook.py shape the payloads, delivery.py posts them with
retries, and service.py is the loop that commits Kafka offsets only after every notification was delivered.
"""
