"""torch forward hooks that feed a recorder, by module or by dotted-name pattern.

Hooks take row keys from the recorder's context (``rec.context(token_ids=..., step=...)``).
Under CUDA graph replay forward hooks do not fire: record with graphs disabled.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from tracediff.record.copies import is_torch_tensor

if TYPE_CHECKING:
    from tracediff.record.recorder import Recorder


def first_tensor(value: Any) -> Any:
    """The tensor a module produced: itself, or the first tensor of a tuple/list/ModelOutput."""
    if is_torch_tensor(value):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        if is_torch_tensor(item):
            return item
    return None


def watch(rec: Recorder, module: Any, output: str | None = None, input: str | None = None) -> Any:
    """Log ``module``'s first input as ``input`` and its output as ``output`` on each forward."""
    if output is None and input is None:
        raise ValueError("watch needs a name for the output and/or the input")

    def hook(_module: Any, args: tuple, result: Any) -> None:
        if not rec.active:
            return
        if input is not None and (x := first_tensor(args)) is not None:
            rec.log(input, x)
        if output is not None and (y := first_tensor(result)) is not None:
            rec.log(output, y)

    return module.register_forward_hook(hook)


def watch_modules(rec: Recorder, root: Any, pattern: str, template: str) -> list[Any]:
    """Watch each submodule of ``root`` whose name matches ``pattern``; ``{*}`` in ``template``
    takes the part ``*`` matched: ``watch_modules(model, "model.layers.*", "target.layer.{*}")``."""
    regex = re.compile("^" + re.escape(pattern).replace(r"\*", "([^.]+)") + "$")
    handles = []
    for name, module in root.named_modules():
        match = regex.match(name)
        if match:
            label = template
            for part in match.groups():
                label = label.replace("{*}", part, 1)
            handles.append(watch(rec, module, output=label))
    if not handles:
        raise ValueError(f"no submodule matches {pattern!r}")
    return handles
