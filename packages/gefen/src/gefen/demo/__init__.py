"""The ``gefen demo``: a small decoder trained on a synthetic language, Gefen against AdamW."""
