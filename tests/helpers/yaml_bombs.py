"""A job file whose YAML aliases expand to hundreds of millions of strings (tests/test_job_limits.py, and the render
service's abuse test, tests/test_serve_abuse.py)."""


def alias_levels(name: str, levels: int = 9) -> list[str]:
    """Nine nested levels of `&a [*a x9]`: 387 million strings once expanded, a few hundred bytes written."""
    out = [f"&{name}0 [{', '.join(['lol'] * 9)}]"]
    out += [f"&{name}{i} [{', '.join([f'*{name}{i - 1}'] * 9)}]" for i in range(1, levels)]
    return out


def alias_bomb() -> str:
    return "version: 1\nmodel: tiny\nshots:\n  - id: s1\n    prompt:\n" + "".join(
        f"      - {level}\n" for level in alias_levels("a"))

