"""Worked examples of `mha-parity --impl`: attention layers a researcher would bring."""
