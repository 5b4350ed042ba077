"""Developer tools that sit beside hybridpipe (not installed with it): the emulated cluster."""
