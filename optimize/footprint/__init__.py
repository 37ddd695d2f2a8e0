"""What an artifact costs on a device: its price in bytes before any export
(:mod:`~optimize.footprint.price`), its memory measured in its runtime and modelled
(:mod:`~optimize.footprint.memory`), and the decode speed and fit predicted for a device it was not
measured on, with the device gates (:mod:`~optimize.footprint.predict`)."""
