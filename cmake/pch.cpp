// Carrier for the precompiled header target.
