"""Experimental verl 0.9 APIs (verl's ``verl.experimental``), as far as this project provides them."""
