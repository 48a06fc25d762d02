"""JSON Schemas of the JSON topics (<prefix>.anomalies, <prefix>.diagnoses); data only."""
