"""Budget: prices, the spending ledger, alerts and the idle guard."""

from .ledger import GuardStatus, MeterReading, Prices, BudgetError, Ledger, set_prices, spent, next_boundary_in

__all__ = ['GuardStatus', 'MeterReading', 'Prices', 'BudgetError', 'Ledger', 'set_prices', 'spent', 'next_boundary_in']
