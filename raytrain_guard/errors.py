"""One exception root for the package.

Every error a user can cause is a :class:`GuardError`. Each one carries the field (or input)
at fault, the value it got and the fix, so the CLI can print one line and exit 2. All of them
pickle, so they survive crossing a Ray actor or worker boundary.
"""

from __future__ import annotations


class GuardError(Exception):
    """Root of every raytrain_guard error."""


class InputError(GuardError, ValueError):
    """Bad user input: names the field, the value it got and the fix.

    ``str(err)`` is a single line: ``"<field>: <problem> (got <value!r>); <fix>"``.
    """

    def __init__(self, field: str, problem: str, *, value: object = None, fix: str = "") -> None:
        self.field = field
        self.problem = problem
        self.value = value
        self.fix = fix
        got = "" if value is None else f" (got {value!r})"
        tail = f"; {fix}" if fix else ""
        super().__init__(f"{field}: {problem}{got}{tail}")

    def __reduce__(self):  # keep keyword-only arguments across pickling
        return (_rebuild_input_error, (type(self), self.field, self.problem, self.value, self.fix))


def _rebuild_input_error(cls, field, problem, value, fix):
    return cls(field, problem, value=value, fix=fix)


class ConfigError(InputError):
    """A configuration field (Python or TOML) is unknown or out of range."""


class PlanInputError(InputError):
    """An input of the capacity planner (size, count, factory, model) is unusable."""


class TraceError(PlanInputError):
    """The user's model could not be traced on the fake or meta device."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line (a message may hold newlines), cut to ``limit`` characters:
    how an error of the user's code or of a library is quoted inside one of ours."""
    message = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_int(field: str, value: object, *, at_least: int = 0, fix: str = "",
              error: type[InputError] = InputError, parse: bool = False) -> int:
    """``value`` if it is an integer >= ``at_least`` (a bool is not), else ``error`` naming
    ``field``, the value as given and ``fix``: the package's one integer check for user input.

    ``parse``: ``value`` may be text (a CLI flag, a ``key=value`` of a spec); a whole number
    written in it (``"8"``, ``" 8 "``) counts as that number, other text is refused as any
    non-integer is."""
    number = value
    if parse and isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            pass   # not a whole number: refused below, with the text as given
    if isinstance(number, bool) or not isinstance(number, int) or number < at_least:
        # InputError leaves a None value out; here None is the value given, so it is shown
        got_none = " (got None)" if value is None else ""
        raise error(field, f"must be an integer >= {at_least}{got_none}", value=value,
                    fix=fix or f"set {field} to an integer >= {at_least}")
    return number
