"""The bench stage (top, beside cli.py): `bcg bench`, diffusers and bcg timed side by side on one job."""
