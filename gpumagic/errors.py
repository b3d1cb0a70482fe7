"""One exception family for gpumagic.

Every error a user can cause or meet carries a one-line ``hint`` that says what to do.
The IPython layer shows ``str(error)`` (message, then the hint) instead of a traceback.
"""

from __future__ import annotations


class GpumagicError(Exception):
    """Base of every gpumagic error.

    Parameters
    ----------
    message : str
        What went wrong, one line.
    hint : str, optional
        What to do about it, one line.
    """

    hint: str = ""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        if hint is not None:
            self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message

    def _render_traceback_(self) -> list[str]:
        """What IPython shows instead of our traceback: ``ClassName: message``, then the hint
        (``InteractiveShell.showtraceback`` calls this where an exception has it)."""
        return [f"{type(self).__name__}: {self}"]


class ConfigError(GpumagicError):
    """A target, an ssh_config entry or an option cannot be understood."""


class HostNotFound(GpumagicError):
    """The name is neither a ~/.ssh/config alias nor resolvable by DNS."""


class ConnectionRefused(GpumagicError):
    """Nothing listens on the port (wrong port, or sshd not running)."""


class ConnectTimeout(GpumagicError):
    """The host did not answer within ConnectTimeout seconds."""


class AuthenticationFailed(GpumagicError):
    """The server refused every key that was offered."""


class WrongPassphrase(GpumagicError):
    """A private key file could not be decrypted with the passphrase given."""


class InsecureKeyFile(GpumagicError):
    """A private key file is readable by group or others (OpenSSH refuses it too)."""


class HostKeyError(GpumagicError):
    """Base for host-key problems."""


class UnknownHostKey(HostKeyError):
    """The server's host key is not in known_hosts; nothing was trusted."""

    def __init__(self, message: str, hint: str, *, host: str, fingerprint: str):
        super().__init__(message, hint)
        self.host = host
        self.fingerprint = fingerprint


class ChangedHostKey(HostKeyError):
    """The server's host key differs from the one in known_hosts."""

    def __init__(self, message: str, hint: str, *, host: str, fingerprint: str):
        super().__init__(message, hint)
        self.host = host
        self.fingerprint = fingerprint


class RevokedHostKey(HostKeyError):
    """The server's host key (or the CA of its certificate) is marked ``@revoked`` in known_hosts.

    Attributes
    ----------
    host : str
        ``host:port`` as gpumagic names it.
    fingerprint : str
        ``SHA256:...`` of the server's key.
    line : str
        ``path:line`` of the ``@revoked`` line.
    """

    def __init__(self, message: str, hint: str, *, host: str, fingerprint: str, line: str):
        super().__init__(message, hint)
        self.host = host
        self.fingerprint = fingerprint
        self.line = line


class ConnectionLost(GpumagicError):
    """The SSH connection dropped while something was running on it."""


class NotConnected(GpumagicError):
    """No machine is connected (or the named one is not)."""


class RemoteTimeout(GpumagicError):
    """A remote command ran longer than its timeout and was stopped."""


class RemoteCommandError(GpumagicError):
    """A remote command or cell exited with a non-zero status.

    Attributes
    ----------
    exit_code : int
        The remote exit status (128 + N when killed by signal N; -1 if unknown).
    stdout, stderr : str
        Everything the command wrote (decoded as UTF-8 with replacement).
    """

    def __init__(self, message: str, *, exit_code: int, stdout: str = "", stderr: str = "",
                 hint: str | None = None):
        super().__init__(message, hint)
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr

    def _render_traceback_(self) -> list[str]:
        # The remote output (traceback included) has already streamed into the cell.
        # Show only the last line of the remote error, never gpumagic's own frames.
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        out = [f"RemoteCommandError: {self.message}"]
        if lines and lines[-1] not in self.message:
            out.append(f"  last line of remote stderr: {lines[-1]}")
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return out


class Interrupted(KeyboardInterrupt):
    """A kernel interrupt that gpumagic has cleaned up after (remote processes stopped).

    It is a ``KeyboardInterrupt`` (so "Run All" stops and ``except KeyboardInterrupt``
    works); IPython shows its one-line message instead of gpumagic's frames.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


class SandboxError(GpumagicError):
    """The local sandbox machine could not be started."""


class SyncError(GpumagicError):
    """A sync could not complete (files already complete stay complete)."""


class SyncDiskFull(SyncError):
    """The destination disk (or quota) is full; the message names the path and mount."""


class SyncPermissionDenied(SyncError):
    """The destination path cannot be written (permissions or a read-only mount)."""


class SyncIncomplete(SyncError):
    """Some source files could not be read and were left out; everything else was synced
    (rsync's exit status 23).  ``summary`` is the sync's :class:`gpumagic.sync.SyncSummary`."""

    def __init__(self, message: str, hint: str | None = None, *, summary=None):
        super().__init__(message, hint)
        self.summary = summary


class LocalFileError(GpumagicError):
    """A local file (a new key, ``~/.ssh/config``) cannot be read or written here."""


class WrapupError(GpumagicError):
    """The machine could not be examined (no python3 there, an unreadable answer)."""


class KernelError(GpumagicError):
    """A remote session cannot be started, found or used as asked."""


class JobError(GpumagicError):
    """A detached job cannot be started, found or stopped as asked."""


class TunnelError(GpumagicError):
    """A port forward could not start, or failed on its background thread."""


class KeyExists(GpumagicError):
    """A key file is already there; gpumagic never overwrites one."""


class HostExists(GpumagicError):
    """``~/.ssh/config`` already has a ``Host`` block with that name."""


class BudgetError(GpumagicError):
    """A budget cannot be computed or a guard cannot be armed (missing prices, no shutdown)."""


class LedgerError(GpumagicError):
    """The ledger file cannot be read or written."""


class NotifyError(GpumagicError):
    """Notifications cannot be set up or sent (no python3 on the machine, not configured)."""


class KernelConnectionLost(ConnectionLost):
    """The SSH connection dropped while a cell ran; the cell keeps running on the machine."""


class RemoteKernelError(GpumagicError):
    """A cell raised on the machine.

    ``_render_traceback_`` gives the machine's IPython traceback (not gpumagic's frames), as
    ipyparallel's ``RemoteError`` does.  :meth:`named` makes one whose class carries the remote
    exception's name (a subclass named ``ZeroDivisionError``, say) and whose ``str()`` is its
    message: IPython records an error as ``type(e).__name__`` and ``str(e)``
    (``InteractiveShell.showtraceback``, ipykernel's ``_showtraceback`` and execute_reply), so
    a notebook saves the machine's ``ename`` and ``evalue``, as with a local kernel.

    Attributes
    ----------
    ename, evalue : str
        The remote exception's type name and message.
    traceback : list of str
        The remote traceback lines as IPython formatted them (with ANSI colours).
    where : str
        ``machine:session`` it was raised in (also in ``hint``).
    """

    def __init__(self, ename: str, evalue: str, traceback: list[str], where: str = ""):
        super().__init__(f"{ename}: {evalue}" + (f" (on {where})" if where else ""),
                         f"raised in session {where}" if where else None)
        self.ename, self.evalue, self.traceback = ename, evalue, list(traceback)
        self.where = where
        if where and hasattr(self, "add_note"):  # Python 3.11+: a plain traceback says where
            self.add_note(f"(raised in session {where})")

    @classmethod
    def named(cls, ename: str, evalue: str, traceback: list[str], where: str = "") -> "RemoteKernelError":
        """A RemoteKernelError whose class is named ``ename`` (when that is an identifier):
        caught as RemoteKernelError, recorded by IPython as ``ename``."""
        kind = cls
        if ename.isidentifier() and ename != cls.__name__:
            kind = type(ename, (cls,), {"__module__": cls.__module__, "__qualname__": ename,
                                        "__doc__": f"{ename} raised on the machine."})
        return kind(ename, evalue, traceback, where)

    def __str__(self) -> str:
        return self.evalue

    def __reduce__(self):
        return _remote_kernel_error, (self.ename, self.evalue, self.traceback, self.where)

    def _render_traceback_(self) -> list[str]:
        return list(self.traceback) or [f"{self.ename}: {self.evalue}"]


def _remote_kernel_error(ename: str, evalue: str, traceback: list[str], where: str) -> RemoteKernelError:
    """Unpickle a :class:`RemoteKernelError` (its class may be made by ``named``)."""
    return RemoteKernelError.named(ename, evalue, traceback, where)


# -- renting machines by API (gpumagic.rent) ------------------------------------------------


class RentError(GpumagicError):
    """A rental platform refused or failed a request (the key is never in the text)."""


class BadKey(RentError):
    """The API key is missing, wrong or revoked (HTTP 401/403)."""


class RateLimited(RentError):
    """The platform answered 429 Too Many Requests."""

    def __init__(self, message: str, hint: str | None = None, *, retry_after: float | None = None):
        super().__init__(message, hint)
        self.retry_after = retry_after


class NoOffer(RentError):
    """No offer fits (GPU, memory, price, region), or the one named is gone."""


class InsufficientBalance(RentError):
    """The account has too little credit for the rental."""


class CreateTimeout(RentError):
    """A create got no answer; gpumagic looked for the instance and made no second one."""


class StuckPending(RentError):
    """The instance did not reach ``running`` in time."""


class NotSupported(RentError):
    """The platform cannot do this (Lambda has no stop)."""


class NoAnswer(RentError):
    """The platform did not answer (timeout, no route): the request may or may not have happened."""


class ReleaseRefused(RentError):
    """``%gpu release`` found results that are only on the machine (or could not check)."""
