"""Budget: what a rented machine costs, alerts before it hurts, and a guard that stops paying
for idle.

* :mod:`~gpumagic.budget.prices`: prices, billing arithmetic, the meter, estimates, platform
  presets (pure).
* :mod:`~gpumagic.budget.ledger`: the local ledger file of prices, limits, alerts and rentals
  (:class:`MachineRecord`, :class:`Rental`).
* :mod:`~gpumagic.budget.guard`: the guard on the machine, and the meter read from it;
  :class:`Budget`, all of it for one machine (``machine.budget``).
* :mod:`~gpumagic.budget.shutdown`: whether and how a machine can shut itself down.
* :mod:`~gpumagic.budget.notify`: alerts by mail or webhook, sent from the machine.
"""

from .guard import Budget, GuardSettings, GuardStatus, arm_guard, cancel_guard, read_meter, read_status
from .ledger import (GuardRecord, Ledger, LedgerError, MachineRecord, Rental, change_prices, check_alerts,
                     data_dir, history, set_prices)
from .prices import (MAX_AMOUNT, MAX_GB, MAX_RATE, PRICE_OPTIONS, BudgetError, MeterReading, Prices, estimate,
                     limit_deadline, meter, money, next_boundary_in, parse_amounts, parse_duration, parse_time,
                     platform, platforms, spent)
from .shutdown import ShutdownPlan, find_shutdown

__all__ = ["MAX_AMOUNT", "MAX_GB", "MAX_RATE", "PRICE_OPTIONS", "Budget", "BudgetError", "GuardRecord", "GuardSettings", "GuardStatus", "Ledger", "LedgerError",
           "MachineRecord", "MeterReading", "Prices", "Rental", "ShutdownPlan", "arm_guard", "cancel_guard",
           "change_prices", "check_alerts", "data_dir", "estimate", "find_shutdown", "history",
           "limit_deadline", "meter", "money", "next_boundary_in", "parse_amounts", "parse_duration",
           "parse_time", "platform", "platforms", "read_meter", "read_status", "set_prices", "spent"]
