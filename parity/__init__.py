"""The one place that imports both frameworks: conversion, the float64 oracle, the harness, the benchmark."""
