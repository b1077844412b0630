build/dmuon simulate --model pi0 --profile a800 --plot docs/sim-pi0-a800.png --json
