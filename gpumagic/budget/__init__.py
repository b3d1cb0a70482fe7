"""Budget: prices, the spending ledger, alerts and the idle guard."""

from .ledger import (BudgetError, GuardStatus, Ledger, MeterReading, Prices, data_dir, next_boundary_in,
                     set_prices, spent)

__all__ = ["BudgetError", "GuardStatus", "Ledger", "MeterReading", "Prices", "data_dir", "next_boundary_in",
           "set_prices", "spent"]
