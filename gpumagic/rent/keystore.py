"""Where the platforms' API keys are kept: the OS keychain through ``keyring``, else a file.

A key is read with ``getpass`` (never an argument, so never in the notebook or its history),
stored under the service ``gpumagic`` with the provider's name as the user name where
``keyring`` has a working backend (macOS Keychain, Windows Credential Locker, the Secret
Service), else in ``DATA/keys/PROVIDER`` (mode 0600, in a 0700 folder,
:func:`gpumagic._fs.private_dir`).  No key is ever written to the ledger, the rentals file or
a log.

For a run with no one to type the key (a test, a script, CI), ``%gpu provider login P`` takes
it from the environment variable ``GPUMAGIC_P_API_KEY`` (:func:`env_var`) when that is set,
instead of asking; the other options of the login likewise default to ``GPUMAGIC_P_BASE_URL``
and so on.  The names carry gpumagic's prefix so that they never mean the key a platform
itself injects into its machines (RunPod puts a pod-scoped ``RUNPOD_API_KEY`` in every pod).
"""

from __future__ import annotations

import getpass
import os
from pathlib import Path

SERVICE = "gpumagic"


def _usable_keyring():
    """The keyring module when a real backend (priority > 0, not the fail/null one) exists."""
    try:
        import keyring
        from keyring.backends import fail
    except ImportError:
        return None
    try:
        backend = keyring.get_keyring()
    except Exception:
        return None
    if isinstance(backend, fail.Keyring) or getattr(backend, "priority", 0) <= 0:
        return None
    if type(backend).__module__.startswith("keyring.backends.null"):
        return None
    return keyring


class KeyStore:
    """API keys by provider name.

    Parameters
    ----------
    directory : path, optional
        The file store's folder (default ``DATA/keys``).
    use_keyring : bool, optional
        ``False``: the file store only; default: the keychain where ``keyring`` has one.
    """

    def __init__(self, directory: str | os.PathLike | None = None, *, use_keyring: bool | None = None):
        if directory is None:
            from ..paths import data_dir

            directory = data_dir() / "keys"
        self.dir = Path(directory)
        self.keyring = None if use_keyring is False else _usable_keyring()

    @property
    def where(self) -> str:
        if self.keyring is not None:
            return f"the OS keychain ({type(self.keyring.get_keyring()).__name__})"
        return f"{self.dir} (mode 0600)"

    def _file(self, provider: str) -> Path:
        return self.dir / provider

    def set(self, provider: str, key: str) -> str:
        """Store ``key``; returns where it went (for the one line the magic prints)."""
        key = key.strip()
        if self.keyring is not None:
            try:
                self.keyring.set_password(SERVICE, provider, key)
                return self.where
            except Exception:
                self.keyring = None  # a locked or broken keychain: the file store
        from .._fs import atomic_write, private_dir

        private_dir(self.dir)
        atomic_write(self._file(provider), key + "\n", mode=0o600)
        return self.where

    def get(self, provider: str) -> str | None:
        if self.keyring is not None:
            try:
                value = self.keyring.get_password(SERVICE, provider)
                if value:
                    return value
            except Exception:
                pass
        try:
            return self._file(provider).read_text(encoding="utf-8").strip() or None
        except OSError:
            return None

    def delete(self, provider: str) -> bool:
        gone = False
        if self.keyring is not None:
            try:
                self.keyring.delete_password(SERVICE, provider)
                gone = True
            except Exception:
                pass
        try:
            self._file(provider).unlink()
            gone = True
        except OSError:
            pass
        return gone


def env_var(provider: str, what: str = "api_key") -> str:
    """The environment variable that gives ``what`` (``api_key``, ``base_url``...) of
    ``provider``'s login: ``env_var("runpod") == "GPUMAGIC_RUNPOD_API_KEY"``."""
    return f"GPUMAGIC_{provider.upper()}_{what.upper()}"


def env_key(provider: str) -> str | None:
    """The key set in :func:`env_var` (stripped), or ``None`` where it is unset or empty."""
    return os.environ.get(env_var(provider), "").strip() or None


def ask_key(provider: str) -> str:
    """Read a key from the user without echo (``getpass``: a password box in Jupyter)."""
    return getpass.getpass(f"API key for {provider} (not shown): ")
