"""`edgetp chat`: the terminal chat app, a client of the REST bridge."""
