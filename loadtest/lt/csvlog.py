"""A CSV file written in batches: the Locust files' record of every request
(a row per request, written by the request hook without a write each time)."""

import csv
import os


class CsvLog:
    """Rows added before open() (or after close()) are dropped."""

    def __init__(self, header, batch):
        self.header, self.batch = header, batch
        self.rows = []
        self.file = None
        self.writer = None

    def open(self, path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.file = open(path, "w", newline="")
        self.writer = csv.writer(self.file)
        self.writer.writerow(self.header)

    def add(self, row):
        if self.file is None:
            return
        self.rows.append(row)
        if len(self.rows) >= self.batch:
            self.flush()

    def flush(self):
        if self.file is not None and self.rows:
            self.writer.writerows(self.rows)
            self.rows.clear()
            self.file.flush()

    def close(self):
        self.flush()
        if self.file is not None:
            self.file.close()
            self.file = None
