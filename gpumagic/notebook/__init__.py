"""The IPython layer: magics, text/HTML displays and widgets."""
