"""The stop that ends a rental's bill, sent from the machine itself.

On vast.ai and RunPod a shutdown inside the container does not stop billing
(``budget/platforms.json``), and Lambda has no stop at all.  For a machine that is a rental
(``%gpu rent``), the budget guard and a job's ``--then-shutdown`` therefore stop it through
the platform's API, **from the machine** (so it works with the laptop closed): the program
``rent-stop.py`` (in ``gpumagic/remote/programs/``) is installed in :data:`BILL_DIR` with its
settings, and its ``stop`` is the command the guard runs instead of ``shutdown``.

Credentials, by platform (see each provider's ``instance_key_env`` for the documents read):

- vast.ai: the per-instance key it injects (``CONTAINER_API_KEY``, ``CONTAINER_ID``);
- RunPod: the pod-scoped key it injects (``RUNPOD_API_KEY``, ``RUNPOD_POD_ID``);
- Lambda: none is injected, and there is no stop: only a release (``--release``) with the
  user's own key placed on the machine by explicit consent (``--with-my-key``), in
  ``BILL_DIR/key``, 0600, removed by ``%gpu budget guard --cancel``;
- AutoDL (elastic deployment): no request at all: a container lives as long as its ``cmd``,
  so the guard ends the ``cmd`` (the provider's ``end_inside``).

``--with-my-key`` also serves an image of vast.ai or RunPod whose SSH sessions cannot see the
injected key.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import BudgetError, NotSupported
from ..remote import program
from ..remote.execution import run_program

if TYPE_CHECKING:
    from .._types import MachineLike
    from ..budget.shutdown import ShutdownPlan
    from .rentals import Renter

#: Where the program, its settings and (only with consent) the user's key live on the machine,
#: relative to the remote $HOME.
BILL_DIR = ".gpumagic/bill"
PROGRAM = "rent-stop.py"
#: Confirmation reads after the request, and seconds between them.
READS, EVERY_S = 5, 2.0


@dataclass
class RentalStop:
    """The bill stop of the rental ``name`` (a record of ``renter``), as a
    :class:`~gpumagic.budget.shutdown.ShutdownPlan` for the guard and ``--then-shutdown``.

    Whether it releases instead of stopping, and whether the user's key may be placed on the
    machine, are the record's ``stop_action`` and ``key_on_machine`` (set by ``%gpu budget
    guard --release --with-my-key``)."""

    renter: "Renter"
    name: str

    def settings(self) -> tuple[dict, str | None]:
        """The program's ``stop.json`` and the user's key to place (``None``: none).

        Raises
        ------
        BudgetError
            The platform cannot stop (``--release`` is missing), or it injects no key and the
            user has not agreed to place theirs (``--with-my-key`` is missing).
        """
        rec = self.renter.record(self.name)
        p = self.renter.provider(rec.provider)
        release = rec.stop_action == "release"
        try:
            how = p.self_stop(rec.instance_id, release=release)
        except NotSupported as e:
            raise BudgetError(f"{self.name}: {e.message}, so the guard can end its bill only by releasing it",
                              "add --release (the instance and its disk are then deleted)"
                              + ("" if p.instance_key_env or rec.key_on_machine else " and --with-my-key")) from None
        if not p.instance_key_env and not rec.key_on_machine:
            raise BudgetError(f"{p.name} puts no API key on its machines, so the guard of {self.name} can "
                              f"{how.action} it only with your key placed there",
                              f"add --with-my-key (it is stored on {self.name} in ~/{BILL_DIR}/key, 0600, "
                              "until `%gpu budget guard --cancel`)")
        config = {"provider": p.name, "name": self.name, "instance_id": rec.instance_id, "base_url": p.base_url,
                  "method": how.method, "path": how.path, "body": how.body, "status_path": how.status_path,
                  "field": list(how.field), "done": list(how.done), "action": how.action,
                  "spacing_s": how.spacing_s, "key_env": p.instance_key_env, "id_env": p.instance_id_env,
                  "env_files": list(p.instance_env_files),
                  "key_file": rec.key_on_machine, "reads": READS, "every_s": EVERY_S}
        key = self.renter.keys.get(p.name) if rec.key_on_machine else None
        if rec.key_on_machine and not key:
            raise BudgetError(f"no API key for {p.name} is stored here to place on {self.name}",
                              f"run `%gpu provider login {p.name}` first")
        return config, key

    def plan(self, machine: MachineLike) -> "ShutdownPlan":
        """Install the program and its settings on ``machine`` and check that it finds its key
        and is on the instance named (one round trip); the plan runs its ``stop``.

        Raises
        ------
        BudgetError
            As :meth:`settings`; no Python 3 on the machine; the injected key not found (say
            ``--with-my-key``); the machine is another instance than the rental's.
        """
        from ..budget.shutdown import ShutdownPlan

        rec = self.renter.record(self.name)
        inside = self.renter.provider(rec.provider).end_inside
        if inside is not None:
            if rec.stop_action == "release":
                raise BudgetError(f"{self.name}: the guard ends an {rec.provider} container from inside (its cmd "
                                  "ends, so does the bill); a release needs the API",
                                  f"arm it without --release, and `%gpu release {self.name}` from the notebook")
            return ShutdownPlan(inside)
        config, key = self.settings()
        payload = json.dumps({"program": program.source(PROGRAM), "config": config, "key": key})
        r = run_program(machine.connection, PROGRAM, "install", BILL_DIR, stdin=payload.encode(), timeout=60)
        line = (r.stdout.strip().splitlines() or [""])[-1]
        word, _, rest = line.partition(" ")
        if word == "ok":
            python, path = rest.split(" ")[:2]
            return ShutdownPlan(f"{shlex.quote(python)} {shlex.quote(path)} stop {shlex.quote(path.rpartition('/')[0])}")
        if word == "nokey":
            raise BudgetError(f"{self.name}: {rest} is not on the machine (its image exports it neither to SSH "
                              "sessions nor to a file read here), so the guard cannot stop the bill from there",
                              f"add --with-my-key to place your {config['provider']} key there instead "
                              f"(~/{BILL_DIR}/key, 0600)")
        if word == "wrongid":
            raise BudgetError(f"{machine.name} is not the {config['provider']} instance {config['instance_id']} "
                              f"of the rental {self.name} ({rest})",
                              f"connect to it with `%gpu start {self.name}`")
        err = (r.stderr.strip().splitlines() or [line or "no output"])[-1]
        raise BudgetError(f"could not install the bill stop on {machine.name}: {err[-200:]}",
                          "it needs python3 on the machine and a writable $HOME")

    def forget_key(self, machine: MachineLike) -> bool:
        """Remove the user's key from the machine (one round trip); whether one was placed."""
        rec = self.renter.record(self.name)
        run_program(machine.connection, PROGRAM, "forget", BILL_DIR, timeout=60)
        return rec.key_on_machine

    def key_statement(self) -> str:
        """The one line that says what is stored where, when the user's key is placed."""
        rec = self.renter.record(self.name)
        return (f"your {rec.provider} API key is stored on {self.name} in ~/{BILL_DIR}/key (0600), for the guard "
                f"to {rec.stop_action} it from there; `%gpu budget guard --cancel` removes it")


__all__ = ["RentalStop", "BILL_DIR"]
