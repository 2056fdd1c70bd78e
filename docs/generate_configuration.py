"""Write docs/configuration.md from GuardConfig's field metadata.

    python docs/generate_configuration.py

tests/test_docs.py fails when the file and the metadata differ.
"""

from pathlib import Path

from raytrain_guard.cli import config_reference_markdown

if __name__ == "__main__":
    path = Path(__file__).resolve().parent / "configuration.md"
    path.write_text(config_reference_markdown())
    print(f"wrote {path}")
