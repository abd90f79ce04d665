"""The command line's checks of its files and options, made before any work.

Inputs must be regular files of bounded size; outputs may not be an input, another output
or a special file, and their folder must be writable; tolerances must be finite and at
most their ceiling. Each problem is a :class:`UsageError`: one line naming it, exit code 2.
"""

from __future__ import annotations

import os
import stat

from taso_jax._io import NamedFiles

__all__ = ["UsageError", "opaque_after_reimport", "check_output_path",
           "check_input_file", "check_checkpoint_text",
           "check_tolerances",
           "check_outputs", "check_output_folder", "MAX_MODEL_BYTES", "MAX_RULE_FILE_BYTES"]


class UsageError(Exception):
    """A problem with the user's input; printed as one line, exit code 2."""


def _parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    out = {}
    for item in items or []:
        name, sep, dims = item.rpartition("=")
        try:
            if not sep or not name:
                raise ValueError
            out[name] = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise UsageError(f"--input-shape {item!r}: expected NAME=D1,D2,... "
                             "(for example x=1,3,224,224)") from None
        if any(d < 1 for d in out[name]):
            raise UsageError(f"--input-shape {item!r}: every size must be at least 1")
        size = 1
        for d in out[name]:
            size *= d
        if size > _MAX_INPUT_ELEMENTS:
            raise UsageError(f"--input-shape {item!r}: {size:,} elements is more than "
                             f"{_MAX_INPUT_ELEMENTS:,}")
    return out


#: Elements of one input at most (2^31: 8 GiB of float32).
_MAX_INPUT_ELEMENTS = 2 ** 31


def _external_data_files(model_path: str) -> set[str]:
    """Absolute paths of the external-data files a model file refers to (ONNX spec)."""
    import onnx

    try:
        model = onnx.load(model_path, load_external_data=False)
    except Exception:  # an unreadable model is reported by the loader, with its own message
        return set()
    folder = os.path.dirname(os.path.abspath(model_path))
    found = set()
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                found.add(os.path.realpath(os.path.join(folder, entry.value)))
    return found


def check_output_path(path: str, option: str, protected: NamedFiles) -> None:
    """Refuse an output path that would lose data, before any long work starts.

    ``protected`` holds the files an output may not be, named (``"the input model"``). The
    path must not name one of them (by path, symbolic links followed, or as the same file:
    a hard link), must not be an existing special file (a device, a folder, a pipe), and
    its folder must exist and be writable.

    Raises:
        UsageError: naming the option and the path.
    """
    if not path:  # an unset variable (-o "$OUT"): never the default path in its place
        raise UsageError(f"{option} '': the path is empty")
    what = protected.what(path)
    if what is not None:
        raise UsageError(f"{option} {path!r} is {what}; choose another path "
                         "(inputs are never overwritten)")
    if os.path.exists(path) and not os.path.isfile(path):
        raise UsageError(f"{option} {path!r} exists and is not a regular file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path!r}: folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{option} {path!r}: folder {folder!r} is not writable")
    _probe_folder(path, option, folder)


def _probe_folder(path: str, option: str, folder: str) -> None:
    """Create and remove a file in ``folder``: what the atomic write will do at the end.

    ``os.access`` answers from the permission bits, and for root almost always yes: a
    read-only mount, ``/proc`` or ``/sys`` pass it and fail only at the write, after the
    whole run.
    """
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".taso_jax.probe.")
    except OSError as e:
        raise UsageError(f"{option} {path!r}: cannot create a file in folder {folder!r} "
                         f"({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


#: Largest model file read: protobuf's limit, 2 GiB (onnx cannot parse a larger file; larger
#: weights live in external-data files, which are not counted).
MAX_MODEL_BYTES = 2 ** 31
#: Largest rule file or checkpoint read: 256 MiB, about a hundred times the shipped set.
MAX_RULE_FILE_BYTES = 2 ** 28


def check_input_file(path: str, what: str, limit: int, must_exist: bool = True) -> None:
    """Refuse an input that is not a regular file of at most ``limit`` bytes, before reading.

    A device (``/dev/zero`` reads until memory runs out), a pipe (blocks forever) or a folder
    is never opened: only ``os.stat`` looks at it. A path that does not exist (a typo, an
    empty path, a symbolic link to nothing) is refused as such, unless ``must_exist`` is
    false (a checkpoint that a run starts): read later, it would be blamed on the run
    (``the input model was deleted or moved during the run``).

    Raises:
        UsageError: naming ``what`` (``"model"``, ``"--substitutions"``) and the path.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if not must_exist:
            return
        if os.path.islink(path):
            raise UsageError(f"{what} {path!r} is a symbolic link to "
                             f"{os.readlink(path)!r}, which does not exist") from None
        raise UsageError(f"{what} {path!r} does not exist") from None
    except OSError as e:
        raise UsageError(f"{what} {path!r}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{what} {path!r} is not a regular file (a folder, a device or a "
                         "pipe is not read)")
    if st.st_size > limit:
        raise UsageError(f"{what} {path!r} is {st.st_size:,} bytes, more than the "
                         f"{limit:,} read at most")


def check_checkpoint_text(path: str, option: str = "--checkpoint") -> None:
    """Refuse an existing file that is not a checkpoint, before any work.

    A checkpoint is appended to: a file named by mistake (a model, an archive, a rule file,
    notes) would get JSON lines written into it. Refused: one that is not UTF-8 text, and
    one with complete (newline-ended, not blank) lines none of which is a checkpoint line
    (:func:`~taso_jax.verify.runner.checkpoint_record`). A checkpoint cut short before its
    first line was complete has no complete line, and is resumed.

    Raises:
        UsageError: naming the option and the path; the file is not touched.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{option} {path!r} is not a checkpoint file (not UTF-8 text, byte "
                         f"{e.start}); it would be appended to: name a new file") from None
    from taso_jax.verify.runner import checkpoint_record

    complete = [line for line in text.split("\n")[:-1] if line.strip()]
    if complete and not any(checkpoint_record(line) for line in complete):
        raise UsageError(f"{option} {path!r} is not a checkpoint file (none of its "
                         f"{len(complete)} complete lines is a proof record); it would be "
                         "appended to: name a new file")


def check_tolerances(args) -> None:
    """Refuse ``--rtol`` or ``--atol`` that is not finite, >= 0 and at most its ceiling.

    ``None`` is the default; the ceilings are :data:`~taso_jax.checks.MAX_RTOL` and
    :data:`~taso_jax.checks.MAX_ATOL`.

    Raises:
        UsageError: naming the option and its value.
    """
    from taso_jax.checks import tolerance_problem

    for option, value in (("--rtol", args.rtol), ("--atol", args.atol)):
        problem = tolerance_problem(option.lstrip("-"), value)
        if problem:
            raise UsageError(f"{option} {value}: {problem}")


def check_outputs(outputs, protected: NamedFiles) -> None:
    """:func:`check_output_path` for each ``(path, option, what)``; ``None`` (not given) is skipped.

    Each checked path joins ``protected`` as ``"<what> (<option>)"``, so that no two of a
    command's outputs are one file and none is one of its inputs.

    Raises:
        UsageError: naming the option and the path.
    """
    for path, option, what in outputs:
        if path is not None:
            check_output_path(path, option, protected)
            protected.add(path, f"{what} ({option})")


def check_output_folder(path: str, option: str) -> None:
    """Refuse an output folder that cannot be made or written, before any long work starts.

    The path must be a folder or not exist yet; then the nearest existing folder above it
    must be writable (it is made with its parents when written).

    Raises:
        UsageError: naming the option and the path.
    """
    full = os.path.abspath(path)
    if os.path.lexists(full) and not os.path.isdir(full):
        raise UsageError(f"{option} {path!r} exists and is not a folder")
    probe = full
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{option} {path!r}: {probe!r} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path!r}: folder {probe!r} is not writable")


def opaque_after_reimport(data, optimized) -> str | None:
    """What the written model (``data``: bytes or a path) loses when imported back, or None.

    The XLA target's file is run by importing it
    (:func:`~taso_jax.frontends.onnx_io.load_onnx`, here at the sizes the graph was
    optimized at); an operator that the export wrote in a form the import does not declare
    comes back opaque and runs in onnxruntime inside ``jax.jit``, one host callback each (a
    streaming VAD's rewritten file ran 13x slower that way before the import read Slices
    with bounds computed at run time). Returns a phrase naming the opaque operators beyond
    the ``optimized`` graph's, or the import's error.
    """
    from collections import Counter

    from taso_jax._text import one_line
    from taso_jax.frontends.onnx_io import load_onnx

    shapes = {n.name: tuple(int(d) for d in n.types[0].shape) for n in optimized.inputs}
    try:
        back = load_onnx(data, shapes)
    except Exception as e:  # noqa: BLE001 - any failure to read our own file keeps the input
        return f"importing it fails: {one_line(str(e), 160)}"

    def opaque(g) -> Counter:
        return Counter(n.attr("call").label for n in g.nodes if n.op == "opaque")

    extra = opaque(back) - opaque(optimized)
    if not extra:
        return None
    return "kept opaque: " + ", ".join(f"{k} x{v}" for k, v in sorted(extra.items()))
