"""The sink: Kafka topics into the store (see writer.py and consumer.py)."""
