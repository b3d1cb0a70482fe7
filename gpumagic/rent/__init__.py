"""Renting machines by API: offers, rent, stop, start, release (RunPod, Lambda Cloud, vast.ai).

:mod:`.base` is the interface and its errors, :mod:`.http` the one HTTP door (pacing, 429,
key redaction), :mod:`.runpod`, :mod:`.lambdacloud` and :mod:`.vast` the platforms, :mod:`.keystore` the API
keys, :mod:`.rentals` the named rentals and their life cycle.  Needs the ``[rent]`` extra
(httpx, keyring).
"""

from .base import (BadKey, CreateTimeout, Instance, InsufficientBalance, NoOffer, NotSupported, Offer, Provider,
                   RateLimited, RentError, StuckPending)
from .keystore import KeyStore
from .rentals import PROVIDERS, NewRental, Renter, is_new_rental, parse_new_rental

__all__ = ["BadKey", "CreateTimeout", "Instance", "InsufficientBalance", "NoOffer", "NotSupported", "Offer",
           "Provider", "RateLimited", "RentError", "StuckPending", "KeyStore", "PROVIDERS", "NewRental", "Renter",
           "is_new_rental", "parse_new_rental"]
