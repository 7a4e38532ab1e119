"""The probe's measuring half: stage layers and links timed on the real devices."""
